"""A dataset split through the predictor into the evaluator: what val.py, training and export.py's gate run."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from utils.evaluation.evaluator import DetectionEvaluator, EvalBatch, ValResults
from utils.evaluation.outputs import ValOutputs
from utils.evaluation.predictor import Predictor, Timer


def evaluate(
    predictor: Predictor,
    loader: Iterable,
    evaluator: DetectionEvaluator,
    outputs: ValOutputs | None = None,
    compute_loss: Any = None,
    gather: bool = False,
) -> ValResults:
    """Every batch of ``loader`` (letterboxed uint8 images, targets, paths, shapes) predicted and matched; ranks'
    results gathered when ``gather``; the summary, with the outputs written when ``outputs`` is given."""
    predictor.timer = Timer()
    for batch_i, (imgs, targets, paths, shapes) in enumerate(loader):
        pred = predictor.predict(imgs, want_raw=compute_loss is not None)
        losses = None
        if compute_loss is not None and pred.raw is not None:
            losses = compute_loss(pred.raw, targets.to(predictor.device))[1]
        batch = EvalBatch(targets, paths, shapes, tuple(pred.images.shape[2:]))
        images = evaluator.update(pred.detections, batch, losses)
        if outputs is not None:
            outputs.on_batch(batch_i, images, pred.images, targets, pred.detections)
    evaluator.add_times(predictor.timer.seconds, predictor.timer.images)
    if gather:
        evaluator.synchronize()
    results = evaluator.summarize()
    if outputs is not None:
        outputs.finish(results, evaluator)
    return results
