"""Object detectors explained per detected instance: torchvision, transformers DETR-style models, Ultralytics YOLO
and models returning {"boxes", "scores"}.

    candidates.py   a detector's output as candidates: boxes and class scores before NMS, in the graph
    instances.py    detected instances (``detect``), and ``InstanceTarget``: each instance's scalar, found again in
                    every forward a method makes (D-RISE's similarity), its disappearance said

Every method takes ``explain(image, instances=...)``; ``explain.ODAM`` and ``explain.DRISE`` are made for detectors.
"""

from .candidates import Candidates, candidates_of, detector_family
from .instances import Instances, InstanceSpec, InstanceTarget, detect, final_detections

__all__ = ["Candidates", "InstanceSpec", "InstanceTarget", "Instances", "candidates_of", "detect", "detector_family",
           "final_detections"]
