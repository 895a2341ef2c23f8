"""The YAML operator registry: the documented example loads and a model calling its ops trains on
DTensors (2 x 2 mesh) and through ``hpfunc.parallelize`` equal to one device; the shipped registry
loads; bad entries name the file, the entry and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

import _registry_helpers as H
from hpfunc.ops import RegistryError, load_registry, shipped_registry


@pytest.mark.multirank
def test_a_model_with_registered_ops_trains_on_dtensors(pools):
    assert max(pools(4).run(H.run_global_view, 0)) <= 1.0


@pytest.mark.multirank
def test_a_model_with_registered_ops_trains_through_parallelize(pools):
    assert max(pools(2).run(H.run_parallelize, 1)) <= 1.0


def test_the_shipped_registry_loads():
    regs = load_registry(shipped_registry())
    assert [str(r.op) for r in regs] == ["aten._scaled_dot_product_flash_attention_for_cpu.default",
                                         "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]


@pytest.mark.parametrize("entry,match", [
    ("- op: nosuchlib::fused\n  rule: 'i -> i'", r"entry 0 \(op nosuchlib::fused\), key 'op': unknown op "
                                                  r"'nosuchlib::fused'"),
    ("- op: aten::mm\n  rule: 'i j, j k -> i k | plus j'", r"entry 0 \(op aten::mm\), key 'rule': .*unknown mark 'plus'"),
    ("- op: aten::mm\n  rule: 'i j, j k -> i j'", r"key 'rule': .*result 0 dimension 1 is named 'j'"),
    ("- op: aten::mm\n  rule: 'i j, j k -> i k | sum j'\n  impl: no_such_module:kernel",
     r"entry 0 \(op aten::mm\), key 'impl': cannot import 'no_such_module:kernel' \(ModuleNotFoundError"),
    ("- op: aten::mm\n  rule: 'i j, j k -> i k | sum j'\n  impl: torch.nn.functional:no_such_function",
     r"key 'impl': cannot import 'torch.nn.functional:no_such_function' \(AttributeError"),
    ("- op: aten::mm\n  rules: 'i j, j k -> i k'", r"entry 0 \(op aten::mm\): unknown key 'rules'"),
    ("- import: no_such_module_either", r"entry 0, key 'import': cannot import 'no_such_module_either'"),
])
def test_bad_entries_name_the_entry_and_key(tmp_path: Path, entry, match):
    path = tmp_path / "registry.yaml"
    path.write_text("ops:\n" + "\n".join("  " + line for line in entry.splitlines()) + "\n")
    with pytest.raises(RegistryError, match=match):
        load_registry(path)
