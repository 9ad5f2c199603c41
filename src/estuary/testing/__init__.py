"""Conformance suites a plugin author runs against their implementation.

Each suite is a class of pytest tests: subclass it in your test module, give it
what it asks for (a fixture or a method), and pytest runs every shared test on
your implementation, the same tests Estuary's own backends pass:

- ``estuary.testing.streams``: ``StreamConformance``, for a stream backend;
- ``estuary.testing.formats``: ``FormatConformance``, ``TextConformance`` and
  ``DelimitedConformance``, for a file format reader;
- ``estuary.testing.stores``: ``StoreConformance`` and
  ``InProcessStoreConformance``, for an embedding store;
- ``estuary.testing.operators``: ``OperatorConformance``, for a task-graph
  source kind.

The suites need pytest: ``pip install 'estuary[testing]'``. Importing
``estuary`` never imports this package.
"""
