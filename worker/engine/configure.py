"""Optional scoring features switched on by settings (trained head, calibration).

Kept apart from the classifier so the core engine has no knowledge of them.
"""

from __future__ import annotations


def apply_scoring_settings(clf, settings) -> None:
    """Hook for the scorer head and calibration settings (see issue: label quality)."""
    return None
