"""The GPU transfer check (tools/gpu_check/) in its CPU mode, as CI runs it so that the
script cannot rot between lent machines: two processes, each with kvpush's own transfer
thread over real NIXL, the three vLLM GPU layouts built as CPU tensors, every byte of both
pools checked after each WRITE and READ; and what its checking and unpacking rest on."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from kvpush.connector.kv_layout import describe
from kvpush.tools.gpu_check import layouts, pack

REPOSITORY = Path(__file__).resolve().parents[2]


def test_the_cpu_mode_moves_every_layout_both_ways_with_every_byte_right(tmp_path):
    out = tmp_path / "gpu-check"
    run = subprocess.run([sys.executable, "-m", "kvpush.tools.gpu_check.check", "--device", "cpu", "--out", str(out),
                          "--layers", "4", "--blocks", "100", "--max-mib", "4", "--repeats", "2"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["every_byte_right"] is True and report["mem_type"] == "DRAM"
    checked = {(r["layout"], r["blocks"]) for r in report["verified"]}
    assert checked == {(layout, kind) for layout in layouts.LAYOUTS for kind in ("scattered", "contiguous")}
    for row in report["verified"]:
        assert row["write_wrong_words"] == row["read_wrong_words"] == 0, row
        assert row["pool_words_checked"] == 4 * 100 * layouts.WORDS_PER_BLOCK
    sizes = [r["bytes"] for r in report["sweep"]]
    assert sizes == [64 << 10, 256 << 10, 1 << 20, 4 << 20]
    assert all(r["ours_gib_s"] > 0 and r["raw_gib_s"] > 0 for r in report["sweep"])
    assert "Every byte right: **True**" in (out / "gpu-check.md").read_text()


@pytest.mark.parametrize("layout", layouts.LAYOUTS)
def test_each_layout_is_one_region_a_layer_of_dense_64_kib_blocks(layout):
    pool = layouts.allocate(layout, layers=3, blocks=20, device="cpu")
    described = describe(pool.views, 20)
    assert len(described.regions) == 3 and len(described.buffers) == 1
    assert all(r.block_len == layouts.BLOCK_BYTES for r in described.regions)
    stride = {"LBNHC": 1, "LBHNC": 1, "BLNHC": 3}[layout] * layouts.BLOCK_BYTES  # blocks outermost: every layer's
    assert all(r.block_stride == stride for r in described.regions)
    assert tuple(pool.views[layouts.layer_name(0)].shape) == (20, layouts.BLOCK_TOKENS, layouts.KV_HEADS,
                                                             layouts.PACKED)


def test_the_check_sees_a_single_wrong_word_and_a_block_copied_to_the_wrong_place():
    pool = layouts.allocate("LBHNC", layers=2, blocks=10, device="cpu")
    layouts.fill(pool, seed=1)
    assert layouts.mismatches(pool, 1, {}) == 0
    pool.words[int(pool.offsets(1)[3]) + 100] += 1  # one word of layer 1, block 3
    assert layouts.mismatches(pool, 1, {}) == 1
    layouts.fill(pool, seed=1)
    source = layouts.allocate("LBHNC", layers=2, blocks=10, device="cpu")
    layouts.fill(source, seed=2)
    pool.base[:, 4] = source.base[:, 6]  # block 6 of the source landed in block 4
    assert layouts.mismatches(pool, 1, {4: (2, 6)}) == 0
    assert layouts.mismatches(pool, 1, {4: (2, 5)}) > 0  # ...not block 5's bytes
    assert layouts.mismatches(pool, 1, {}) > 0


def _wheel(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("demo/__init__.py", "VALUE = 1\n")
        wheel.writestr("demo-1.0.dist-info/METADATA", "Name: demo\n")
        wheel.writestr("demo-1.0.data/platlib/demo_native.py", "NATIVE = 2\n")
        wheel.writestr("demo-1.0.data/scripts/demo-tool", "#!/bin/sh\n")
    return path


def test_a_repacked_wheel_unpacks_as_an_installer_lays_it_out(tmp_path):
    carry, site = tmp_path / "carry", tmp_path / "site"
    carry.mkdir()
    packed = pack.repack(_wheel(tmp_path / "demo-1.0-py3-none-any.whl"), carry)
    assert packed.name == "demo-1.0-py3-none-any.whl.tar.xz"
    assert pack.unpack(carry, site) == [packed.name]
    assert (site / "demo" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (site / "demo_native.py").read_text() == "NATIVE = 2\n"  # .data/platlib merged in
    assert not (site / "demo-tool").exists() and not (site / "demo-1.0.data").exists()


def test_a_carry_archive_with_a_path_outside_the_package_is_refused(tmp_path):
    carry = tmp_path / "carry"
    carry.mkdir()
    with tarfile.open(carry / "evil-1.0-py3-none-any.whl.tar.xz", "w:xz") as tar:
        entry = tarfile.TarInfo("../escaped.py")
        entry.size = 1
        tar.addfile(entry, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match="outside"):
        pack.unpack(carry, tmp_path / "site")
    assert not (tmp_path / "escaped.py").exists()


def test_the_kvpush_path_imports_the_repositorys_folders_without_kvpush_installed(tmp_path):
    """As on the device: no site-packages (``-S``: here that also hides the installed
    kvpush), only the folder on PYTHONPATH."""
    into = pack.kvpush_path(REPOSITORY, tmp_path / "path")
    probe = subprocess.run([sys.executable, "-S", "-c", "import kvpush.tools.gpu_check.pack as m; print(m.__file__)"],
                           capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(into)},
                           cwd=tmp_path)  # not the repository's root: its kvpush/ folder would come first
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == str(into / "kvpush" / "tools" / "gpu_check" / "pack.py")
