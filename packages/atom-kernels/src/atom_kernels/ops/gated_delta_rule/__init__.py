"""The gated delta rule (Gated DeltaNet): ``gated_delta_rule_chunked`` (varlen prefill, chunked WY/UT
form) and ``gated_delta_rule_recurrent`` (decode / MTP verify, a state per token)."""

from atom_kernels.ops.gated_delta_rule.checks import (
    check_gated_delta_rule_chunked,
    check_gated_delta_rule_recurrent,
)

__all__ = ["check_gated_delta_rule_chunked", "check_gated_delta_rule_recurrent"]
