"""LoRA adapters through `LLM` (docs/lora.md): loading, saving, adding and unloading
adapters, each name and adapter checked before the engine's LoraManager takes it.
"""

from __future__ import annotations

from jaxinfer.models import get_model
from jaxinfer.user_input import check_text


class LoraAPI:
    """LLM's adapter methods; they use the LLM's engine (its LoraManager) and model config."""

    def load_lora(self, name: str, path: str) -> None:
        """Loads the adapter saved in directory `path` under `name`: a PEFT adapter
        (adapter_config.json and adapter_model.safetensors) or one save_lora wrote, checked
        against the model (shapes, target modules, rank <= max_lora_rank): a ValueError names
        what does not fit. It takes a device slot when a request first uses it
        (docs/lora.md)."""
        from jaxinfer.lora import adapters

        self._check_lora_name(name)
        if name in self._engine.loras.adapters:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded; unload it first")
        read = adapters.read_orbax if adapters.is_orbax_adapter(path) else adapters.read_peft
        adapter = read(name, path, family=get_model(self.model_config.architecture),
                       cfg=self.model_config, max_rank=self._engine.loras.max_rank)
        self._engine.loras.add(adapter)

    def save_lora(self, name: str, path: str) -> None:
        """Writes loaded adapter `name` to directory `path` in jaxinfer's form (orbax arrays
        and jaxinfer_lora.json), which load_lora reads back."""
        from jaxinfer.lora.adapters import save_adapter

        if name not in self._loras().adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        save_adapter(self._engine.loras.adapters[name], path)

    def add_lora(self, adapter) -> None:
        """Loads an adapter already read (jaxinfer.lora.adapters.Adapter, e.g. from
        adapters.from_peft_arrays)."""
        self._check_lora_name(adapter.name)
        if adapter.rank > self._engine.loras.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}; max_lora_rank "
                             f"is {self._engine.loras.max_rank}")
        self._engine.loras.add(adapter)

    def unload_lora(self, name: str) -> None:
        """Drops a loaded adapter (ValueError while running requests use it)."""
        self._loras()
        if name not in self._engine.loras.adapters:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        users = [r for r in list(self._engine.waiting) + self._engine.slots
                 if r is not None and r.lora == name]
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished "
                             "sequences; unload it when they finish")
        self._engine.loras.remove(name)

    def list_loras(self) -> list[dict]:
        """The loaded adapters: name, rank, scale, path and device slot (None: host only)."""
        if self._engine.loras is None:
            return []
        m = self._engine.loras
        return [{"name": a.name, "rank": a.rank, "scale": a.scale, "path": a.path,
                 "slot": m.slot_of(a.name)} for a in m.adapters.values()]

    def _loras(self):
        if self._engine.loras is None:
            raise ValueError("LoRA adapters need LLM(..., max_loras=N) (N device slots)")
        return self._engine.loras

    def _check_lora_name(self, name) -> None:
        self._loras()
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string of at most 256 "
                             f"characters, got {name!r}")
        check_text(name, "lora name")
