"""Layer-wise push on a prefill worker: which regions' layers are computed, and so which
layers each open send may announce (`PushRuntime.layers_ready`).

A `Send(layerwise=True)` is opened with no layer ready on the step that computes the
request's last prompt tokens; each `save_kv_layer` then says a layer is computed: on CPU
its KV is in the cache when vLLM calls it, on a GPU only once an event recorded on the
compute stream after it has completed. A region is announced once all the layers that
share it are (a hybrid model's region holds a layer of each KV-cache group). A Mamba
layer never says it is computed (vLLM calls `save_kv_layer` from attention layers only);
the forward pass runs the layers in order, so each state layer numbered before a
computed layer is computed too. `wait_for_save` (the step's forward is over) announces
whatever is left.

`LayerAnnouncer` holds that state for one worker rank and answers with `Announcement`s;
the worker hands them to its runtime and counts them. It imports no vLLM (torch only
for a device's events).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Who said the layers are computed: vLLM's per-layer hook, or the step's end.
BY_LAYER, BY_STEP = "save_kv_layer", "wait_for_save"


def layer_number(name: str) -> int | None:
    """A vLLM layer's number in the model, from its name (`model.layers.3.self_attn`)."""
    number = next((part for part in name.split(".") if part.isdigit()), None)
    return None if number is None else int(number)


@dataclass(frozen=True, slots=True)
class Announcement:
    """Part `part_id` may now read `layers` (regions), as `by` said."""

    part_id: str
    layers: tuple[int, ...]
    by: str


class LayerAnnouncer:
    """One worker rank's layer-wise bookkeeping. `layer_of`: vLLM's layer name -> its
    region (`kvcache.layer_slots`); `regions`: the regions the rank registered;
    `state_layers`: a hybrid model's Mamba layers."""

    def __init__(
        self, layer_of: Mapping[str, int], regions: Iterable[int], state_layers: Iterable[str]
    ) -> None:
        self._layer_of = dict(layer_of)
        names: dict[int, set[str]] = {}
        for name, index in self._layer_of.items():
            names.setdefault(index, set()).add(name)
        self._names_of = {index: frozenset(n) for index, n in names.items()}
        self.all_layers = frozenset(regions)
        # Each numbered Mamba layer's number in the model, read once (`computed` asks
        # for every layer vLLM computes).
        self._state_numbers = {
            name: n for name in state_layers if (n := layer_number(name)) is not None
        }
        # The layer names computed on this step, of regions not complete.
        self._saved_names: set[str] = set()
        # Per part of this step's layer-wise sends, the regions not announced yet; device
        # events not yet complete.
        self._pending: dict[str, set[int]] = {}
        self._events: list[tuple[str, torch.cuda.Event]] = []

    @property
    def num_layers(self) -> int:
        """How many of vLLM's layers the rank registered."""
        return len(self._layer_of)

    def __bool__(self) -> bool:
        """Whether a part of this step still waits for a layer to be announced."""
        return bool(self._pending)

    def new_step(self) -> list[Announcement]:
        """A new step begins: what the last one left unannounced (a step that never
        reached `wait_for_save` computed every layer all the same), then nothing
        pending."""
        left = self.step_done() if self._pending else []
        self._pending = {}
        self._saved_names = set()
        return left

    def expect(self, part_id: str) -> None:
        """A layer-wise part opened on this step: every region is to be announced."""
        self._pending[part_id] = set(self.all_layers)

    def saved(self, layer_name: str, kv_layer: torch.Tensor) -> list[Announcement]:
        """vLLM computed `layer_name` for this step (`save_kv_layer`)."""
        if not self._pending or layer_name not in self._layer_of:
            return []  # nothing waits, or not a layer we registered
        if kv_layer.device.type == "cpu":
            return self._computed((layer_name,), BY_LAYER)
        import torch

        # Kernels are queued, not done: announce once the stream got past this layer.
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(kv_layer.device))
        self._events.append((layer_name, event))
        return self._flush_events(wait=False)

    def step_done(self) -> list[Announcement]:
        """The step's forward is over (`wait_for_save`): every layer is computed."""
        if not self._pending:
            return []
        return self._flush_events(wait=True) + self._announce(self.all_layers, BY_STEP)

    def _flush_events(self, *, wait: bool) -> list[Announcement]:
        done: list[str] = []
        while self._events:
            name, event = self._events[0]
            if wait:
                event.synchronize()
            elif not event.query():  # type: ignore[no-untyped-call]
                break
            self._events.pop(0)
            done.append(name)
        return self._computed(done, BY_LAYER) if done else []

    def _computed(self, names: Iterable[str], by: str) -> list[Announcement]:
        """These layers are computed: the regions all of whose layers now are."""
        names = list(names)
        new = set(names)
        for name in names:
            number = layer_number(name)
            if number is not None:
                new.update(s for s, before in self._state_numbers.items() if before < number)
        new -= self._saved_names
        self._saved_names |= new
        complete = {
            self._layer_of[name]
            for name in new
            if name in self._layer_of and self._names_of[self._layer_of[name]] <= self._saved_names
        }
        return self._announce(complete, by) if complete else []

    def _announce(self, layers: Iterable[int], by: str) -> list[Announcement]:
        wanted = set(layers)
        out = []
        for pid, remaining in list(self._pending.items()):
            new = remaining & wanted
            if not new:
                continue
            remaining.difference_update(new)
            if not remaining:
                del self._pending[pid]
            out.append(Announcement(pid, tuple(sorted(new)), by))
        return out
