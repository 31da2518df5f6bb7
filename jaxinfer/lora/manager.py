"""Which adapters are loaded (host memory) and which sit in the device's slots.

Loading an adapter reads and checks it into host memory; a request that uses it takes a slot
when it is admitted: the slot already holding it, else a free one, else the least recently used
slot whose adapter no running sequence holds (written over: the adapter stays on the host and
comes back when asked for). With every slot held by running sequences the request waits.
Writing a slot is one dispatch of a program compiled at warmup; nothing recompiles.
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable, Optional

from jaxinfer.lora.adapters import Adapter


class LoraManager:
    def __init__(self, num_slots: int, max_rank: int, write: Callable[[int, Adapter], None],
                 max_cpu_loras: Optional[int] = None):
        self.num_slots, self.max_rank, self.max_cpu_loras = num_slots, max_rank, max_cpu_loras
        self._write = write
        self.adapters: dict[str, Adapter] = {}
        self.versions: dict[str, int] = {}          # load counter: prefix-cache namespaces
        self._loads = itertools.count(1)
        self.slot_holder: list[Optional[str]] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self._holders: dict[str, set] = collections.defaultdict(set)   # name -> sequence ids
        self._held: dict = {}                                          # sequence id -> name
        self.writes = 0

    # ---- host memory --------------------------------------------------------------------------

    def add(self, adapter: Adapter) -> None:
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded; unload "
                             "it first")
        if self.max_cpu_loras is not None and len(self.adapters) >= self.max_cpu_loras:
            raise ValueError(f"{len(self.adapters)} adapters are loaded; max_cpu_loras is "
                             f"{self.max_cpu_loras}: unload one first")
        self.adapters[adapter.name] = adapter
        self.versions[adapter.name] = next(self._loads)

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise KeyError(name)
        if self._holders.get(name):
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(self._holders[name])} "
                             "running sequences; unload it when they finish")
        del self.adapters[name]
        for n, holder in enumerate(self.slot_holder):
            if holder == name:
                self.slot_holder[n] = None

    def replace(self, adapter: Adapter) -> None:
        """Swaps a loaded adapter's weights (LLM.update_weights): a new prefix-cache namespace,
        and the slot holding it, if any, rewritten now."""
        if adapter.name not in self.adapters:
            raise KeyError(adapter.name)
        self.adapters[adapter.name] = adapter
        self.versions[adapter.name] = next(self._loads)
        slot = self.slot_of(adapter.name)
        if slot is not None:
            self._write(slot, adapter)
            self.writes += 1

    def salt(self, name: Optional[str]) -> bytes:
        """The prefix-cache namespace of an adapter's sequences (b"": the base model's)."""
        return b"" if name is None else f"lora:{name}:{self.versions[name]}".encode()

    # ---- device slots ------------------------------------------------------------------------

    def slot_of(self, name: str) -> Optional[int]:
        return self.slot_holder.index(name) if name in self.slot_holder else None

    def acquire(self, name: str, seq_ids: list) -> Optional[int]:
        """A slot holding adapter `name` for the sequences seq_ids, written if needed; None
        when every slot is held by running sequences of other adapters."""
        slot = self.slot_of(name)
        if slot is None:
            idle = [n for n, h in enumerate(self.slot_holder)
                    if h is None or not self._holders.get(h)]
            if not idle:
                return None
            slot = min(idle, key=lambda n: (self.slot_holder[n] is not None, self._last_used[n]))
            self._write(slot, self.adapters[name])
            self.writes += 1
            self.slot_holder[slot] = name
        for s in seq_ids:
            self._holders[name].add(s)
            self._held[s] = name
        self._last_used[slot] = next(self._clock)
        return slot

    def release(self, seq_id) -> None:
        """A sequence that finished or was preempted lets go of its adapter (no-op if none)."""
        name = self._held.pop(seq_id, None)
        if name is not None:
            self._holders[name].discard(seq_id)

    def resident(self) -> dict:
        return {h: n for n, h in enumerate(self.slot_holder) if h is not None}
