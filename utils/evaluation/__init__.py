"""Evaluation: the predictor (images to detections, any format) and the evaluator (detections against ground truth),
and the loop that joins them over a dataset split."""
