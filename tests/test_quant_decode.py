"""The in-register decoders' bit recipes (``kernels/quant_decode``) over every byte value: int4
nibbles and e4m3 codes (subnormals and signed zeros included) decode exactly. The PTX itself
runs on GPUs only (``tests/gpu/test_quant_gpu.py::test_every_code_decodes_exactly``)."""
from __future__ import annotations

import torch

from flash_dllm.kernels import quant_decode, quant_gemm

BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def test_int4_recipe_is_each_nibble_minus_8():
    lo, hi = quant_decode.int4_pair_reference(BYTES)
    assert lo.dtype == hi.dtype == torch.bfloat16
    assert torch.equal(lo.float(), (BYTES.int() & 0xF).float() - 8)
    assert torch.equal(hi.float(), (BYTES.int() >> 4).float() - 8)
    # the same values as the module's own unpacking
    both = torch.stack([lo, hi], -1).flatten().float()
    assert torch.equal(both, quant_gemm.unpack(BYTES.view(1, -1), 4).flatten().float())


def test_e4m3_recipe_is_exact_for_every_finite_code():
    got = quant_decode.e4m3_reference(BYTES).float()
    want = BYTES.view(torch.float8_e4m3fn).float()
    finite = ~torch.isnan(want)
    assert int(finite.sum()) == 254
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))   # -0 too
    subnormal = finite & ((BYTES.int() & 0x78) == 0) & ((BYTES.int() & 0x7) != 0)
    assert int(subnormal.sum()) == 14 and torch.equal(got[subnormal], want[subnormal])
