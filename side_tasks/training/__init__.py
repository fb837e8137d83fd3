"""Small model training side tasks (see :mod:`side_tasks.training.tasks`).

Submit as ``side_tasks.training:ResNet18Training`` (``{"dataset": "digits"}`` or a CIFAR
directory) or ``side_tasks.training:LSTMLanguageModelTraining`` (``{"text": "python-docs"}`` or
a text file).
"""

from side_tasks.training.data import load_image_dataset, load_text
from side_tasks.training.models import LSTMLanguageModel, ResNet18
from side_tasks.training.tasks import LSTMLanguageModelTraining, ResNet18Training

__all__ = [
    "LSTMLanguageModel",
    "LSTMLanguageModelTraining",
    "ResNet18",
    "ResNet18Training",
    "load_image_dataset",
    "load_text",
]
