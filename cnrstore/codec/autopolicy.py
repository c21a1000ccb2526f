"""The "auto" quantization policy: the scheme a job's checkpoints can afford, from how many
restores it expects (docs/QUANTIZATION.md, "The auto policy"; the bands are measured by
benches/quality.py, docs/QUALITY.md)."""

from __future__ import annotations

# "auto" policy (docs/QUANTIZATION.md, "The auto policy"): quantization error compounds
# with every restore (each restore resumes training from the dequantized tables), so the
# fewer restores a job expects, the fewer bits its checkpoints can afford. The bands come
# from benches/quality.py (docs/QUALITY.md): paired runs on a synthetic CTR task and on
# MovieLens-100k, 1, 5 and 20 restores per scheme; a band's scheme is the one writing the
# fewest bytes whose 95% interval stayed inside Check-N-Run's 0.01% budget (loss and AUC)
# on both tasks at every measured count up to the band's end (quality_report.derive_policy;
# tests/test_quality.py checks these bands against the committed measurement).
AUTO_POLICY: tuple[tuple[float, str], ...] = ((5.0, "int8"), (20.0, "fp16"))
# int4, the only measured scheme cheaper than int8, is out of budget at one restore on the
# synthetic task; int8 leaves it at 20 restores on MovieLens. Beyond 20 nothing was
# measured, and the store does not extrapolate.
AUTO_BEYOND = "exact"


def auto_scheme(expected_restores: float) -> str:
    """The scheme the "auto" policy picks for a job expecting this many restores."""
    if isinstance(expected_restores, bool) or not isinstance(expected_restores, (int, float)):
        raise TypeError(f"expected_restores must be a number, got {expected_restores!r}")
    if not expected_restores >= 0 or expected_restores == float("inf"):
        raise ValueError(f"expected_restores must be finite and >= 0, got {expected_restores}")
    for most, scheme in AUTO_POLICY:
        if expected_restores <= most:
            return scheme
    return AUTO_BEYOND
