"""Causal depthwise conv1d of the GDN q|k|v stream: ``causal_conv1d_varlen`` (prefill) and
``causal_conv1d_update`` (decode / MTP verify with the left-aligned window state)."""

from atom_kernels.ops.conv1d.checks import check_causal_conv1d_update, check_causal_conv1d_varlen

__all__ = ["check_causal_conv1d_update", "check_causal_conv1d_varlen"]
