"""Evaluation on a held-out index range: mean IoU and recall at IoU >= 0.5, and averaged over IoU 0.5:0.95, of
slot-matched boxes.

Prediction slot j of an image is matched to its target box j (the loss's matching; targets are in the
dataset's canonical left-to-right order), and only valid boxes (j < counts[b]) count. The trivial
baseline predicts one constant box, the mean of all valid held-out target boxes, in every slot: a
detector that has learnt nothing about the image scores about that.

Why not average precision: AP ranks detections by a score and counts the false ones; this detector (the article's)
predicts exactly one box for each true face, paired by slot, and no score. Its precision equals its recall at every
IoU threshold, so recall is the measure, and ``recall50_95`` is COCO's average over the thresholds 0.5, 0.55, ...,
0.95 applied to it: what AP@[.5:.95] would be for a detector that is given the number of faces.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detector.data import PaddedTargets, to_device
from detector.losses.geometry import giou_loss_per_box

IOU_THRESHOLD = 0.5  # a box "found" at IoU >= 0.5, the usual detection criterion
COCO_THRESHOLDS = torch.linspace(0.5, 0.95, 10)  # COCO's IoU thresholds


def box_iou(pred: Tensor, target: Tensor) -> Tensor:
    """IoU of matched box pairs [..., 4] xyxy, in fp32; shape [...]. The loss's geometry: a box's area
    is (x2 - x1) * (y2 - y1), and a degenerate pair (zero union) has IoU 0."""
    x1, y1, x2, y2 = pred.float().unbind(-1)
    x1g, y1g, x2g, y2g = target.float().unbind(-1)
    inter = (torch.minimum(x2, x2g) - torch.maximum(x1, x1g)).clamp(min=0) * (
        torch.minimum(y2, y2g) - torch.maximum(y1, y1g)
    ).clamp(min=0)
    union = (x2 - x1) * (y2 - y1) + (x2g - x1g) * (y2g - y1g) - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-12), 0.0)


def matched_boxes(pred: Tensor, targets: PaddedTargets) -> tuple[Tensor, Tensor]:
    """The valid (prediction, target) pairs of a batch: two [N, 4] fp32 tensors, image by image."""
    valid = torch.arange(pred.shape[1], device=pred.device) < targets.counts[:, None]  # [B, M]
    return pred[valid].float(), targets.boxes[valid].float()


def box_metrics(pred: Tensor, target: Tensor) -> dict[str, float]:
    """mean_iou, recall50, recall50_95 and the GIoU loss over N matched pairs [N, 4] (all 0 when N = 0)."""
    if target.shape[0] == 0:
        return {"mean_iou": 0.0, "recall50": 0.0, "recall50_95": 0.0, "loss": 0.0}
    iou = box_iou(pred, target)
    return {
        "mean_iou": iou.mean().item(),
        "recall50": (iou >= IOU_THRESHOLD).float().mean().item(),
        "recall50_95": (iou[:, None] >= COCO_THRESHOLDS.to(iou.device)).float().mean().item(),
        "loss": giou_loss_per_box(pred, target).mean().item(),
    }


@torch.no_grad()
def evaluate(model, batches, device: torch.device, autocast) -> dict[str, float]:
    """The model's metrics on padded-layout ``batches`` and, as ``trivial_*``, the mean box's."""
    was_training = model.training
    model.eval()
    preds, targets = [], []
    for batch in batches:
        images, padded = to_device(batch, device)
        with autocast:
            pred = model(images)  # [B, M, 4] xyxy
        p, t = matched_boxes(pred, padded)
        preds.append(p)
        targets.append(t)
    model.train(was_training)
    pred, target = torch.cat(preds), torch.cat(targets)  # [N, 4] each
    mean_box = target.mean(0, keepdim=True).expand_as(target) if len(target) else target
    trivial = box_metrics(mean_box, target)
    return box_metrics(pred, target) | {f"trivial_{k}": v for k, v in trivial.items()} | {"boxes": len(target)}
