"""The registry helper: names, lazy "module:attr" entries, install hints and
entry-point plugins."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from estuary.config.errors import ConfigError
from estuary.registry import PluginImportError, Registry


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, code: str) -> None:
    """Write module ``name`` on a temporary sys.path entry."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_a_registered_object_is_found_by_name() -> None:
    reg: Registry[int] = Registry("number")
    reg.register("one", 1)
    assert reg.get("one") == 1
    assert reg.names() == ["one"]
    assert "one" in reg and "two" not in reg


def test_an_unknown_name_names_the_field_and_the_known_names() -> None:
    reg: Registry[int] = Registry("number")
    reg.register("one", 1)
    reg.register("two", 2)
    with pytest.raises(ConfigError) as err:
        reg.get("three", where="x.numbers[0]")
    assert str(err.value) == "x.numbers[0]: number 'three' is unknown (available: one, two)"
    assert err.value.path == "x.numbers[0]"
    shaped: Registry[int] = Registry("number", unknown="unknown {kind} {name!r} ({known})")
    with pytest.raises(ConfigError, match=r"^y: unknown number 'three' \(none\)$"):
        shaped.get("three", "y")


def test_the_load_time_check_reads_like_a_closed_choice_in_registration_order() -> None:
    reg: Registry[int] = Registry("number")
    reg.register("two", 2)
    reg.register("one", 1)
    reg.check("one", "n")  # known: nothing raised, nothing imported
    with pytest.raises(ConfigError) as err:
        reg.check("tow", "x.n")
    assert str(err.value) == "x.n: must be one of 'two', 'one'; got str 'tow' (did you mean 'two'?)"


def test_a_module_attr_entry_is_imported_on_first_get_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "estuary_test_lazy", "IMPORTS = [1]\nVALUE = object()\n")
    reg: Registry[object] = Registry("thing")
    reg.register("lazy", "estuary_test_lazy:VALUE")
    assert reg.names() == ["lazy"]
    assert "estuary_test_lazy" not in sys.modules  # listing imports nothing
    first = reg.get("lazy")
    assert first is sys.modules["estuary_test_lazy"].VALUE
    assert reg.get("lazy") is first


def test_adapt_runs_once_on_a_lazily_imported_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "estuary_test_adapt", "class Reader:\n    pass\n")
    reg: Registry[object] = Registry("reader", adapt=lambda cls: cls())
    reg.register("r", "estuary_test_adapt:Reader")
    got = reg.get("r")
    assert type(got).__name__ == "Reader"
    assert reg.get("r") is got


def test_a_module_that_registers_itself_on_import_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg: Registry[object] = Registry("kind")
    monkeypatch.setattr(sys.modules[__name__], "SELF_REGISTERING", reg, raising=False)
    _module(
        tmp_path,
        monkeypatch,
        "estuary_test_selfreg",
        f"""
        import {__name__} as t
        def build():
            pass
        t.SELF_REGISTERING.register("k", ("wrapped", build))
        """,
    )
    reg.register("k", "estuary_test_selfreg:build")
    got = reg.get("k")
    assert isinstance(got, tuple) and got[0] == "wrapped"


def test_a_missing_optional_package_gives_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "estuary_test_needs", "import estuary_no_such_client\n")
    reg: Registry[object] = Registry("stream kind")
    reg.register("kafka", "estuary_test_needs:BACKEND", extra="streams", package="kafka-py")
    with pytest.raises(PluginImportError) as err:
        reg.get("kafka")
    assert str(err.value) == (
        "stream kind 'kafka' needs the 'kafka-py' package: "
        "pip install 'estuary[streams]' (or pip install kafka-py)"
    )
    assert isinstance(err.value, ImportError)


def test_the_install_hint_error_class_is_the_registrys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class MyError(Exception):
        pass

    _module(tmp_path, monkeypatch, "estuary_test_needs2", "import estuary_no_such_client\n")
    reg: Registry[object] = Registry("format", missing_error=MyError)
    reg.register("orc", "estuary_test_needs2:Reader", package="pyorc")
    with pytest.raises(
        MyError, match=r"^format 'orc' needs the 'pyorc' package: pip install pyorc$"
    ):
        reg.get("orc")


def test_a_broken_entry_without_an_extra_raises_the_import_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _module(tmp_path, monkeypatch, "estuary_test_broken", "import estuary_no_such_module\n")
    reg: Registry[object] = Registry("thing")
    reg.register("b", "estuary_test_broken:X")
    with pytest.raises(ModuleNotFoundError, match="estuary_no_such_module"):
        reg.get("b")


def test_registering_is_the_decorator_form_of_register() -> None:
    reg: Registry[object] = Registry("model")

    @reg.registering("tiny")
    class Tiny:
        pass

    assert reg.get("tiny") is Tiny
    reg.unregister("tiny")
    assert reg.names() == []


def test_a_lazy_entry_must_name_module_and_attribute() -> None:
    with pytest.raises(ValueError, match="expected 'module:attr'"):
        Registry("thing").register("x", "no_colon_here")


def _dist_info(root: Path, dist: str, group: str, entries: dict[str, str]) -> None:
    """A minimal installed distribution with entry points, on ``root``."""
    info = root / f"{dist}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "\n".join(f"{name} = {target}" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}\n")


def test_an_entry_point_plugin_is_listed_lazily_and_loaded_on_get(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dist_info(tmp_path, "estuary_test_plugin", "estuary.tests", {"lion": "estuary_test_ep:LION"})
    _module(tmp_path, monkeypatch, "estuary_test_ep", "LION = 'a lion'\n")
    reg: Registry[object] = Registry("optimizer", group="estuary.tests")
    reg.register("sgd", 1)
    assert reg.names() == ["lion", "sgd"]
    assert "estuary_test_ep" not in sys.modules  # listed, not imported
    assert reg.get("lion", where="opt.name") == "a lion"
    assert "lion" in Registry("optimizer", group="estuary.tests")  # found on a miss


def test_an_entry_point_does_not_replace_a_registered_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dist_info(tmp_path, "estuary_test_shadow", "estuary.tests2", {"sgd": "estuary_test_sh:X"})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[object] = Registry("optimizer", group="estuary.tests2")
    reg.register("sgd", 1)
    assert reg.get("sgd") == 1


def test_an_entry_point_whose_module_is_missing_names_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _dist_info(tmp_path, "estuary_test_gone", "estuary.tests3", {"gone": "estuary_gone_mod:X"})
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry[str] = Registry("model", group="estuary.tests3")
    with pytest.raises(PluginImportError, match=r"model 'gone' \(an entry point of estuary_test"):
        reg.get("gone")


def test_the_dict_interface_of_the_replaced_registries() -> None:
    reg: Registry[int] = Registry("number")
    reg["one"] = 1
    assert reg["one"] == 1 and list(reg) == ["one"] and len(reg) == 1
    with pytest.raises(KeyError):
        reg["two"]
    del reg["one"]
    assert reg.pop("one", None) is None and "one" not in reg


def test_copy_imports_lazy_entries_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _module(tmp_path, monkeypatch, "estuary_test_copy", "X = object()\n")
    reg: Registry[object] = Registry("thing")
    reg.register("x", "estuary_test_copy:X")
    first = reg.get("x")
    clone = reg.copy()
    monkeypatch.delitem(sys.modules, "estuary_test_copy")
    assert clone.get("x") is not first  # re-imported
    assert importlib.import_module("estuary_test_copy").X is clone.get("x")
