"""The gated delta rule (Gated DeltaNet): ``gated_delta_rule_chunked`` (varlen prefill, chunked WY/UT
form), ``gated_delta_rule_recurrent`` (decode: Q tokens from and back to one slot per sequence) and
``gated_delta_rule_verify`` (MTP verify with deferred commit: one state per sequence plus the pending tokens
of the previous step)."""

from atom_kernels.ops.gated_delta_rule.checks import (
    check_gated_delta_rule_chunked,
    check_gated_delta_rule_recurrent,
    check_gated_delta_rule_verify,
    pending_width,
)

__all__ = [
    "check_gated_delta_rule_chunked",
    "check_gated_delta_rule_recurrent",
    "check_gated_delta_rule_verify",
    "pending_width",
]
