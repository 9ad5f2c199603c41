"""One registry helper for every plugin kind: implementations found by name.

Modelled on fsspec's registry: a name maps either to the object itself or to a
``"module:attr"`` string imported on first use, so optional dependencies are
needed only by the jobs that name them; an entry may carry the pip extra that
provides them, and a missing one fails with an install hint; third-party
packages add implementations through Python entry points, which are read only on
a miss or when the names are listed::

    OPTIMIZERS = Registry("sparse optimizer", group="estuary.optimizers")
    OPTIMIZERS.register("adagrad", "estuary.embedding.optimizers:Adagrad")
    cls = OPTIMIZERS.get("adagrad", where="model.embedding.default.optimizer.name")
    OPTIMIZERS.names()   # ['adagrad', ...], entry points included, nothing imported

    BACKENDS = Registry("stream kind", group="estuary.streams")
    BACKENDS.register("nats", "estuary.data.streams.nats:BACKEND",
                      extra="streams", package="nats-py")
    BACKENDS.get("nats")  # without nats-py: PluginImportError "stream kind 'nats'
                          # needs the 'nats-py' package: pip install 'estuary[streams]' ..."

A third-party package declares, in its ``pyproject.toml``::

    [project.entry-points."estuary.optimizers"]
    sign_sgd = "sign_sgd_estuary.optim:SignSGD"

An unknown name is a ``ConfigError`` naming the field path and the known names:
``get`` says ``model.embedding.default.optimizer.name: sparse optimizer 'lamb' is
unknown (available: adagrad, adam, ftrl, rowwise_adagrad, rowwise_adagrad_elem,
rowwise_adam, sgd)``;
``check``, which the config loader runs on every name in a job file, words it like
any closed choice there (``must be one of 'sgd', 'adagrad', 'adam', ...; got str
'lamb'``).

The registry also reads like a dict (``name in r``, ``r[name]``, ``r[name] =
obj``, ``del r[name]``, ``list(r)``), so the module-level dicts it replaced
(``MODELS``, ``TRANSFORMS``, ...) keep working. The registries of Estuary's
plugin kinds are in ``estuary.plugins``.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from estuary.errors import ConfigError

__all__ = ["PluginImportError", "Registry"]

T = TypeVar("T")

_UNKNOWN = "{kind} {name!r} is unknown (available: {known})"


class PluginImportError(ImportError):
    """A registered implementation's module (or a package it needs) is not installed."""


@dataclass(frozen=True)
class _Entry:
    """One registered name: the object, a ``"module:attr"`` string or an entry point."""

    target: Any
    extra: str | None = None  # the estuary extra that installs what it needs
    package: str | None = None  # the pip package that provides the missing module
    lazy: bool = False  # ``target`` is still to be imported
    section: Any = None  # its job-file section's declaration, or ``"module:attr"``


class Registry(Generic[T]):
    """Implementations of one plugin kind, by name.

    Args:
        kind: what an implementation is, in errors (``"sparse optimizer"``).
        group: the entry-point group third-party packages register under
            (``"estuary.optimizers"``); ``None`` = no entry points.
        adapt: applied once to an object imported lazily (a ``"module:attr"``
            string or an entry point), e.g. to instantiate a reader class;
            objects registered directly are stored as given.
        missing_error: the exception class raised with the install hint.
        unknown: the unknown-name message, formatted with ``kind``, ``name``
            and ``known`` (the names, comma-separated).
    """

    def __init__(
        self,
        kind: str,
        *,
        group: str | None = None,
        adapt: Callable[[Any], T] | None = None,
        missing_error: Callable[[str], Exception] = PluginImportError,
        unknown: str = _UNKNOWN,
    ) -> None:
        self.kind = kind
        self.group = group
        self._adapt = adapt
        self._missing_error = missing_error
        self._unknown = unknown
        self._entries: dict[str, _Entry] = {}
        self._loaded: dict[str, T] = {}  # lazy entries, once imported
        self._lock = threading.RLock()  # lazy imports may race; an import may look up more

    # -- registering -----------------------------------------------------------

    def register(
        self,
        name: str,
        obj: T | str,
        *,
        extra: str | None = None,
        package: str | None = None,
        section: Any = None,
    ) -> None:
        """Make ``obj`` available as ``name``, replacing any earlier entry.

        Args:
            name: the name job files use.
            obj: the implementation, or ``"module:attr"`` to import on first ``get``
                (a string is always such a reference).
            extra: the ``estuary[extra]`` that installs the modules it needs; the
                install hint names it when they are missing.
            package: the pip package whose absence the hint reports.
            section: the declaration of the job-file fields this implementation
                reads (a dataclass), or ``"module:attr"`` naming it in a light
                module, so the loader checks a job without importing ``obj`` and
                the packages it needs; see ``section``.
        """
        if not name:
            raise ValueError(f"{self.kind}: a registered name must not be empty")
        lazy = isinstance(obj, str)
        for ref in (obj, section) if isinstance(section, str) else (obj,):
            if isinstance(ref, str) and ":" not in ref:
                raise ValueError(f"{self.kind} {name!r}: expected 'module:attr', got {ref!r}")
        self._entries[name] = _Entry(obj, extra, package, lazy, section)
        self._loaded.pop(name, None)

    def registering(self, name: str, **options: Any) -> Callable[[T], T]:
        """Decorator form of ``register``: ``@REG.registering("adam")``."""

        def add(obj: T) -> T:
            self.register(name, obj, **options)
            return obj

        return add

    def unregister(self, name: str) -> None:
        """Forget ``name`` (a no-op when it is not registered)."""
        self._entries.pop(name, None)
        self._loaded.pop(name, None)

    def copy(self) -> Registry[T]:
        """A registry with the same entries; lazy ones are imported again on use (tests)."""
        out: Registry[T] = Registry(
            self.kind,
            group=self.group,
            adapt=self._adapt,
            missing_error=self._missing_error,
            unknown=self._unknown,
        )
        out._entries = dict(self._entries)
        return out

    # -- looking up --------------------------------------------------------------

    def names(self) -> list[str]:
        """Every name ``get`` accepts, sorted; entry points are listed, not imported."""
        self._discover()
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        if name in self._entries:
            return True
        if not isinstance(name, str):
            return False
        self._discover()
        return name in self._entries

    def get(self, name: str, where: str = "") -> T:
        """The implementation registered as ``name``, importing it on first use.

        Args:
            name: the registered name.
            where: the job-file field path that named it, for errors.

        Raises:
            ConfigError: ``name`` is unknown (at ``where``, listing the known names).
            PluginImportError: (or the registry's ``missing_error``) a module it
                needs is not installed; the message says what to install.
        """
        if name not in self:
            known = ", ".join(self.names()) or "none"
            raise ConfigError(where, self._unknown.format(kind=self.kind, name=name, known=known))
        entry = self._entries[name]
        if not entry.lazy:
            return cast(T, entry.target)
        with self._lock:
            if name not in self._loaded:
                obj = self._import(name, entry)
                now = self._entries.get(name)
                if now is not None and now is not entry and not now.lazy:
                    # The module registered ``name`` itself while importing (a
                    # decorator): that object is the implementation.
                    return cast(T, now.target)
                self._loaded[name] = obj
            return self._loaded[name]

    def section(self, name: str, where: str = "") -> Any:
        """The declaration of the job-file section that ``name``'s implementation
        reads (a dataclass), or ``None`` when it declares none.

        It is the one given to ``register`` (imported from its light module when a
        ``"module:attr"`` string), else the implementation's ``section``
        attribute, which imports the implementation: a plugin registered in
        Python or through an entry point declares its fields there.

        Raises:
            ConfigError: ``name`` is unknown (at ``where``).
            PluginImportError: the implementation is needed and cannot be imported.
        """
        if name not in self:
            self.get(name, where)  # raises the unknown-name error
        declared = self._entries[name].section
        if isinstance(declared, str):
            module_name, _, attr = declared.partition(":")
            return getattr(importlib.import_module(module_name), attr)
        if declared is not None:
            return declared
        return getattr(self.get(name, where), "section", None)

    def check(self, name: str, where: str) -> None:
        """The config loader's check of a job-file value naming an implementation;
        imports nothing.

        Raises:
            ConfigError: ``name`` is unknown, worded like any closed choice in a
                job file: ``where: must be one of 'sgd', 'adagrad', ...; got str
                'adamw' (did you mean 'adam'?)``, the names in registration order.
        """
        if name in self:
            return
        self._discover()
        choices = ", ".join(repr(n) for n in self._entries)
        close = difflib.get_close_matches(name, list(self._entries), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(where, f"must be one of {choices}; got str {name!r}{hint}")

    def _import(self, name: str, entry: _Entry) -> T:
        target = entry.target
        try:
            if isinstance(target, importlib.metadata.EntryPoint):
                obj = target.load()
            else:
                module_name, _, attr = cast(str, target).partition(":")
                obj = getattr(importlib.import_module(module_name), attr)
        except ModuleNotFoundError as e:
            is_plugin = isinstance(target, importlib.metadata.EntryPoint)
            ours = (e.name or "").partition(".")[0] == "estuary"
            optional = entry.package is not None or entry.extra is not None
            if not is_plugin and (ours or not optional):
                raise  # a bug or a broken install, not a missing optional extra
            raise self._missing_error(self._hint(name, entry, e)) from e
        return self._adapt(obj) if self._adapt is not None else cast(T, obj)

    def _hint(self, name: str, entry: _Entry, error: ModuleNotFoundError) -> str:
        """The install hint for a missing module."""
        if isinstance(entry.target, importlib.metadata.EntryPoint):
            dist = getattr(entry.target.dist, "name", None) or "its package"
            return (
                f"{self.kind} {name!r} (an entry point of {dist}) cannot be imported: "
                f"{error}; reinstall {dist} with its dependencies"
            )
        package = entry.package or error.name or "its client package"
        if entry.extra is None:
            return f"{self.kind} {name!r} needs the {package!r} package: pip install {package}"
        return (
            f"{self.kind} {name!r} needs the {package!r} package: "
            f"pip install 'estuary[{entry.extra}]' (or pip install {package})"
        )

    def _discover(self) -> None:
        """Add the entry points of ``group`` not registered otherwise (lazily).

        Names registered in Python (and the built-ins) win over entry points, so a
        plugin cannot silently replace a built-in."""
        if self.group is None:
            return
        for point in importlib.metadata.entry_points(group=self.group):
            if point.name not in self._entries:
                self._entries[point.name] = _Entry(point, lazy=True)

    # -- the dict interface of the registries it replaced -------------------------

    def __getitem__(self, name: str) -> T:
        if name not in self:
            raise KeyError(name)
        return self.get(name)

    def __setitem__(self, name: str, obj: T) -> None:
        self.register(name, obj)

    def __delitem__(self, name: str) -> None:
        del self._entries[name]
        self._loaded.pop(name, None)

    def pop(self, name: str, default: Any = None) -> Any:
        """Remove ``name`` and return its (possibly unimported) entry, or ``default``."""
        entry = self._entries.pop(name, None)
        loaded = self._loaded.pop(name, None)
        if entry is None:
            return default
        return loaded if loaded is not None else entry.target

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
