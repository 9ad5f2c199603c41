"""Stream-source tests (a package so the conformance suite can be shared)."""
