"""Label quality: metrics, labelled data, few-shot picking, a trained scorer head, calibration."""
