"""FP8 block quantisation config of the published Qwen3-Next-80B-A3B-*-FP8 checkpoints."""

from __future__ import annotations

from dataclasses import dataclass

from atom_core._reader import FieldReader

SUPPORTED_FP8_FORMATS = ("e4m3",)


@dataclass(frozen=True)
class Fp8QuantConfig:
    """``quantization_config`` with ``quant_method: fp8``.

    Weights are e4m3 with one float32 scale per ``weight_block_size`` block (stored as
    ``<name>.weight_scale_inv``, a multiplier despite the name); activations are quantised dynamically
    per token and per group of ``weight_block_size[1]`` input channels. Modules whose name matches an
    entry of ``modules_to_not_convert`` stay in the checkpoint dtype.
    """

    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_reader(cls, r: FieldReader) -> Fp8QuantConfig:
        method = r.str("quant_method")
        if method != "fp8":
            raise r.fail("quant_method", method, "only 'fp8' block quantisation is supported")
        fmt = r.str("fmt", "e4m3")
        if fmt not in SUPPORTED_FP8_FORMATS:
            raise r.fail("fmt", fmt, f"supported FP8 formats: {list(SUPPORTED_FP8_FORMATS)}")
        scheme = r.str("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise r.fail("activation_scheme", scheme, "only dynamic activation quantisation is supported")
        block = r.int_list("weight_block_size")
        if len(block) != 2 or any(b <= 0 for b in block):
            raise r.fail("weight_block_size", list(block), "expected two positive integers [n, k]")
        skip = r.str_list("modules_to_not_convert", [])
        return cls(fmt, scheme, (block[0], block[1]), skip)
