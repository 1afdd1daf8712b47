"""Per-device kernel tiles kept as data (``kernels/tuned_configs``): the file format, the row
bucket a step of M rows takes, the override folder, bad files refused by field, and the W8A16 /
W4A16 GEMM taking a file's tiles (the int4 joined-nibble tile included) with the reference's
values."""
from __future__ import annotations

import json

import pytest
import torch

from flash_dllm.kernels import fp8_gemm, quant_gemm, tuned_configs
from flash_dllm.kernels._triton import HAS_TRITON

needs_interpreter = pytest.mark.skipif(not (HAS_TRITON and quant_gemm.INTERPRET),
                                       reason="needs triton under TRITON_INTERPRET=1")
DEVICE = "NVIDIA H100 80GB HBM3"
TILE = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 1}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv(tuned_configs.ENV, str(tmp_path))
    tuned_configs._load.cache_clear()
    yield tmp_path
    tuned_configs._load.cache_clear()


def test_device_key_and_path():
    assert tuned_configs.device_key(DEVICE) == "nvidia_h100_80gb_hbm3"
    assert tuned_configs.config_path("quant_gemm", DEVICE, "/x").as_posix() == \
        "/x/quant_gemm/nvidia_h100_80gb_hbm3.json"


def test_write_then_lookup_by_row_bucket(folder):
    configs = {"int8_N64_K128_g32": {"16": {**TILE, "SPLIT_K": 2}, "64": TILE}}
    tuned_configs.write(tuned_configs.config_path("quant_gemm", DEVICE, folder), "quant_gemm",
                        DEVICE, configs, "a test")
    look = lambda M: tuned_configs.lookup("quant_gemm", DEVICE, "int8_N64_K128_g32", M)
    assert look(1)["SPLIT_K"] == 2 and look(16)["SPLIT_K"] == 2      # the bucket that holds M
    assert look(17)["SPLIT_K"] == 1 and look(500)["SPLIT_K"] == 1    # past the end: the last
    assert tuned_configs.lookup("quant_gemm", DEVICE, "int4_N64_K128_g32", 8) is None
    assert tuned_configs.lookup("quant_gemm", "another card", "int8_N64_K128_g32", 8) is None
    look(16)["SPLIT_K"] = 99                                         # a copy: the table stays
    assert look(16)["SPLIT_K"] == 2


@pytest.mark.parametrize("data,field", [
    ({"version": 2, "configs": {}}, "version"),
    ({"version": 1, "configs": []}, "configs"),
    ({"version": 1, "configs": {"k": {}}}, "configs\\['k'\\]"),
    ({"version": 1, "configs": {"k": {"0": TILE}}}, "row count '0'"),
    ({"version": 1, "configs": {"k": {"32": {"BLOCK_M": "16"}}}}, "configs\\['k'\\]\\['32'\\]"),
])
def test_a_bad_file_is_refused_naming_the_field(folder, data, field):
    path = tuned_configs.config_path("quant_gemm", DEVICE, folder)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field) as e:
        tuned_configs.lookup("quant_gemm", DEVICE, "k", 1)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("tile,msg", [({"SPLIT_K": 0}, "SPLIT_K = 0"),
                                      ({"BLOCK_N": 48}, "BLOCK_N = 48"),
                                      ({"JOIN": 3}, "JOIN = 3"),
                                      ({"BLOCK_SIZE_K": 64}, "unknown tile 'BLOCK_SIZE_K'")])
def test_a_bad_tile_is_refused_before_any_launch(tile, msg):
    with pytest.raises(ValueError, match=msg):
        quant_gemm.check_tile({**TILE, **tile}, "a test")
    assert quant_gemm.check_tile(dict(TILE), "a test") == TILE


def test_the_env_folder_overrides_key_by_key_and_is_read_per_setting(folder, tmp_path,
                                                                      monkeypatch):
    """A key the env folder lacks falls through to the package's file; changing the env
    setting is seen without a cache reset."""
    pkg = tmp_path / "pkg"
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", pkg)
    tuned_configs.write(tuned_configs.config_path("quant_gemm", DEVICE, pkg), "quant_gemm",
                        DEVICE, {"a": {"32": TILE}, "b": {"32": TILE}}, "package")
    env = tmp_path / "env"
    tuned_configs.write(tuned_configs.config_path("quant_gemm", DEVICE, env), "quant_gemm",
                        DEVICE, {"a": {"32": {**TILE, "SPLIT_K": 4}}}, "sweep")
    monkeypatch.setenv(tuned_configs.ENV, str(env))
    assert tuned_configs.lookup("quant_gemm", DEVICE, "a", 32)["SPLIT_K"] == 4
    assert tuned_configs.lookup("quant_gemm", DEVICE, "b", 32)["SPLIT_K"] == 1
    monkeypatch.delenv(tuned_configs.ENV)
    assert tuned_configs.lookup("quant_gemm", DEVICE, "a", 32)["SPLIT_K"] == 1


def test_the_cpu_never_looks_for_tiles():
    assert quant_gemm.tuned_config(32, 64, 128, 32, 8, torch.device("cpu")) is None


@needs_interpreter
@pytest.mark.parametrize("bits", [8, 4])
def test_the_gemm_takes_the_files_tiles(bits, monkeypatch):
    """A tuned entry is what the kernel launches with (here: the int4 joined-nibble tile and a K
    split), and the values stay the reference's."""
    seen = []
    tile = {**TILE, "SPLIT_K": 2, "JOIN": 1}
    monkeypatch.setattr(quant_gemm, "tuned_config",
                        lambda *a: seen.append(a) or dict(tile))
    g = torch.Generator().manual_seed(bits)
    q, s = quant_gemm.quantize(torch.randn(48, 128, generator=g) * 0.05, bits, 32)
    x = torch.randn(5, 128, generator=g)
    got = quant_gemm.weight_only_triton(x, q, s, None, bits)
    assert seen and seen[0][:5] == (5, 48, 128, 32, bits)
    torch.testing.assert_close(got, quant_gemm.weight_only_reference(x, q, s, None, bits),
                               rtol=1e-5, atol=1e-5)


@needs_interpreter
@pytest.mark.parametrize("join", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_joined_nibbles_equal_the_reference(dtype, join):
    """Both one-dot nibble reads (joined, and each byte loaded for both its columns)."""
    g = torch.Generator().manual_seed(3)
    q, s = quant_gemm.quantize(torch.randn(40, 256, generator=g) * 0.05, 4, 64)
    x = torch.randn(9, 256, generator=g).to(dtype)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 2, "JOIN": join}
    got = quant_gemm.weight_only_triton(x, q, s, None, 4, cfg)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), quant_gemm.weight_only_reference(x, q, s, None, 4)
                               .float(), rtol=tol, atol=tol)


@needs_interpreter
@pytest.mark.parametrize("code", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("split", [1, 2])
def test_the_transposed_dots_equal_the_reference(code, split):
    """The ``SWAP`` tile (``W @ x^T`` into a transposed accumulator, scaled per row, transposed
    once): the reference's values for each code, with and without a K split, with a bias."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(80, 256, generator=g) * 0.05
    if code == "fp8":
        q8, s8 = fp8_gemm.quantize_weight(w)
        q, s, bits = q8, s8.view(-1, 1), 8
    else:
        bits = 4 if code == "int4" else 8
        q, s = quant_gemm.quantize(w, bits, 64)
    x = torch.randn(7, 256, generator=g)
    bias = torch.randn(80, generator=g)
    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split, "SWAP": 1}
    got = quant_gemm.weight_only_triton(x, q, s, bias, bits, cfg)
    want = quant_gemm.weight_only_reference(x, q, s, bias, bits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert quant_gemm.check_tile({"SWAP": 1}, "t") == {"SWAP": 1}
    with pytest.raises(ValueError, match="SWAP = 2"):
        quant_gemm.check_tile({"SWAP": 2}, "t")
