"""The bit recipe of ptx._e4m3_bf16_lines (the dense SM90 kernel's e4m3 -> bf16 expansion),
modelled in torch on every e4m3 value: cvt's exact f16, its exponent and mantissa fields moved
down 3 bits with the sign kept, is the bf16 value times 2^-112; times 2^112 it is the value
the f32 route (and the reference's cast) gives. The kernels' GPU tests check the PTX itself."""

import torch

from torch_mla.cute_kernels import ptx


def _bf16_bits_of_f16_pairs(h: torch.Tensor) -> torch.Tensor:
    """The recipe on 32-bit words of two f16 values: (h & 0x7fff7fff) >> 3 | (h & 0x80008000)."""
    return ((h & 0x7FFF7FFF) >> 3) | (h & 0x80008000)


def test_every_e4m3_value_by_the_integer_route():
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    v = v[~v.float().isnan()]
    f16 = v.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    # pairs as cvt.rn.f16x2.e4m3x2 leaves them: value 2i in the low half, 2i + 1 in the high
    lo, hi = f16[0::2], f16[1::2]
    words = _bf16_bits_of_f16_pairs(lo | (hi << 16))
    got = torch.stack([words & 0xFFFF, words >> 16], 1).reshape(-1)
    got = got.to(torch.int16).view(torch.bfloat16).float() * 2.0**112  # the fma: exact
    want = v.to(torch.bfloat16).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bits: -0 stays -0
    # every value lands as a normal bf16 (|v| 2^-112 >= 2^-121), so the fma sees no subnormal
    scaled = got[got != 0].abs() * 2.0**-112
    assert scaled.min() >= 2.0**-126


def test_the_ptx_holds_the_recipe():
    text = ptx._e4m3_asm(True, hw=True, int_bf16=True)
    assert text.count("cvt.rn.f16x2.e4m3x2") == 8 and text.count("fma.rn.bf16x2") == 8
    assert "and.b32 t0, h0, 0x7fff7fff;" in text and "shr.b32 t0, t0, 3;" in text
    # lop3 0xf8 = a | (b & c): the shifted magnitude, h's sign bits where c has them
    assert "lop3.b32 t0, t0, h0, 0x80008000, 0xf8;" in text
    # 2^112 in both bf16 halves: exponent field 112 + 127 = 0xef
    assert ptx._BF16X2_2_112 == "0x77807780"
    assert torch.tensor([2.0**112]).to(torch.bfloat16).view(torch.int16).item() == 0x7780
