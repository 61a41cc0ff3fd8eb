"""The shipped compiler verdicts (``pallax.executor.facts``) and the files that hold them."""

import dataclasses
import functools
import json

import pytest

from pallax.executor import cache as cache_lib
from pallax.executor import facts
from pallax.executor.cache import (
  DiskCache,
  defaults_dir,
  device_name,
  read_shipped,
  update_shipped,
)
from pallax.executor.config import KernelConfig
from pallax.executor.implementation import Target
from pallax.executor.registry import kernel_spec, registered_ops


def test_device_names_of_jax_kinds_and_short_names():
  assert device_name("NVIDIA H100 80GB HBM3") == "h100"
  assert device_name("NVIDIA A100-SXM4-80GB") == "a100"
  assert device_name("TPU v5 lite") == "v5e"
  assert device_name("TPU v6 lite") == "v6e"
  assert device_name("v5e") == "v5e"
  assert device_name("nvidia_h100_80gb_hbm3") == "h100"  # a slug, as pallax.tune passes it
  assert device_name("tpu_v6_lite") == "v6e"
  assert device_name("TPU v5") == "v5p"  # nothing shipped for it


def test_devices_of_targets_and_kinds():
  assert facts.devices_of("cuda") == ("h100", "a100")
  assert facts.devices_of("interpret-triton") == ("h100", "a100")
  assert facts.devices_of("tpu") == ("v5e", "v6e")
  assert facts.devices_of("h100") == ("h100",)
  assert facts.devices_of("NVIDIA A100-SXM4-40GB") == ("a100",)
  assert facts.devices_of("tpu", "triton_raw") == ("h100", "a100")  # raw Triton runs on GPUs
  assert facts.devices_of("b200") == ()
  assert facts.devices_of(Target("cuda", "h100")) == ("h100",)
  assert facts.devices_of(Target("tpu", "v6e")) == ("v6e",)
  assert facts.devices_of(Target("cuda", "b200")) == ("h100", "a100")  # none measured on it
  assert facts.devices_of(Target("cuda")) == ("h100", "a100")


def test_a_verdict_holds_for_the_configs_and_calls_it_names():
  blocks_only = facts.Verdict({"block_m": 128, "block_k": 64}, {"itemsize": 4}, "spills")
  config = {"block_m": 128, "block_k": 64, "num_warps": 8, "implementation": "pallas"}
  assert blocks_only.holds(config, {"itemsize": 4, "transpose_a": True})
  assert not blocks_only.holds(config, {"itemsize": 2, "transpose_a": True})
  assert not blocks_only.holds({**config, "block_k": 32}, {"itemsize": 4})
  assert not blocks_only.holds({"block_m": 128}, {"itemsize": 4})  # a field it names is missing
  everywhere = facts.Verdict({"block_m": 128}, {}, "spills")
  assert everywhere.holds(config, {})
  assert facts.Verdict.from_dict(blocks_only.to_dict()) == blocks_only


@dataclasses.dataclass(frozen=True)
class _Config(KernelConfig):
  block: int
  num_warps: int = 4


def test_written_verdicts_read_back_and_reject_on_their_devices(tmp_path, monkeypatch):
  def change(data):
    data["rejected"] = [
      {"config": {"block": 64}, "when": {"width": 2}, "reason": "ptxas: 24 bytes spilled"}
    ]

  path = update_shipped(tmp_path, "NVIDIA A100-SXM4-80GB", "toy_kernel", 3, change)
  assert path == tmp_path / "a100" / "toy_kernel.json"
  data = json.loads(path.read_text())
  assert (data["format"], data["op"], data["op_version"], data["entries"]) == (
    cache_lib.FORMAT,
    "toy_kernel",
    3,
    {},
  )
  facts.verdicts.cache_clear()
  monkeypatch.setattr(facts, "shipped_file", functools.partial(read_shipped, tmp_path))
  monkeypatch.setattr(facts, "kernel_spec", lambda op: type("Spec", (), {"version": 3}))
  try:
    reason = facts.rejection("cuda", "toy_kernel", _Config(block=64, num_warps=8), {"width": 2})
    assert reason == "a100: ptxas: 24 bytes spilled"
    assert facts.rejection("a100", "toy_kernel", {"block": 64}, {"width": 2}) is not None
    assert facts.rejection("h100", "toy_kernel", {"block": 64}, {"width": 2}) is None
    assert facts.rejection("tpu", "toy_kernel", {"block": 64}, {"width": 2}) is None
    assert facts.rejection("cuda", "toy_kernel", {"block": 32}, {"width": 2}) is None
    assert facts.rejection("cuda", "toy_kernel", {"block": 64}, {"width": 4}) is None
    with facts.ignored():
      assert facts.rejection("cuda", "toy_kernel", {"block": 64}, {"width": 2}) is None
    assert facts.rejection("cuda", "toy_kernel", {"block": 64}, {"width": 2}) is not None
    # A file written for another version of the kernel says nothing.
    monkeypatch.setattr(facts, "kernel_spec", lambda op: type("Spec", (), {"version": 4}))
    facts.verdicts.cache_clear()
    with pytest.warns(RuntimeWarning, match="version 3"):
      assert facts.rejection("cuda", "toy_kernel", {"block": 64}, {"width": 2}) is None
  finally:
    facts.verdicts.cache_clear()


def test_tuned_configs_go_under_the_short_name_in_the_package_only(tmp_path):
  kind = "NVIDIA H100 80GB HBM3"
  assert DiskCache(defaults_dir()).path(kind, "matmul") == defaults_dir() / "h100" / "matmul.json"
  assert DiskCache(tmp_path).path(kind, "matmul").parent.name == "nvidia_h100_80gb_hbm3"


def test_importing_tuned_configs_keeps_the_verdicts(tmp_path):
  """``pallax.tune --import --into <defaults>`` merges entries and leaves ``rejected`` alone."""
  verdict = {"config": {"block": 64}, "when": {}, "reason": "spills"}
  update_shipped(tmp_path, "h100", "toy_kernel", 1, lambda data: data.update(rejected=[verdict]))
  DiskCache(tmp_path).store("h100", "toy_kernel", 1, {"key": {"config": {"block": 16}}})
  data = read_shipped(tmp_path, "h100", "toy_kernel", 1)
  assert data["rejected"] == [verdict]
  assert data["entries"] == {"key": {"config": {"block": 16}}}
  # and writing verdicts keeps the tuned entries
  update_shipped(tmp_path, "h100", "toy_kernel", 1, lambda data: data.update(rejected=[]))
  assert read_shipped(tmp_path, "h100", "toy_kernel", 1)["entries"] == data["entries"]


def test_every_shipped_file_is_for_a_kernel_as_it_is_now():
  """Each file parses for its kernel's current version; each verdict names its config's fields."""
  files = sorted(defaults_dir().glob("*/*.json"))
  assert files
  known = set(registered_ops())
  for path in files:
    kernel, device = path.stem, path.parent.name
    assert device in facts.KNOWN_DEVICES, path
    assert kernel in known, path
    spec = kernel_spec(kernel)
    data = read_shipped(defaults_dir(), device, kernel, spec.version)
    assert data, f"{path} is not a {kernel} v{spec.version} file"
    fields = {f.name for f in dataclasses.fields(spec.config_cls)}
    for record in data.get("rejected", ()):
      assert set(record["config"]) <= fields, (path, record)
      assert record["reason"], (path, record)
