"""Multi-LoRA: many adapters over one base model, mixed in one step (docs/lora.md).

weights.py holds the device side (slots, the low-rank term of the linear layer); adapters.py
reads PEFT adapters and checks them against the model; manager.py assigns adapters to slots.
"""

from jaxinfer.lora.weights import TARGETS, LoraSlots, LoraStep, LoraWeight

__all__ = ["TARGETS", "LoraSlots", "LoraStep", "LoraWeight"]
