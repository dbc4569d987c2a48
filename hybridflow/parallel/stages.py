"""Which pipeline stage, and which model chunk on it, holds each parameter: the one answer to it.

A pipeline of `pp` stages with `vpp` model chunks per stage (megatron-core's
interleaved schedule; vpp = 1 is the plain pipeline) cuts the model's
decoder layers into pp * vpp blocks of equal size and hands them out round
robin: block j sits on stage j % pp as its chunk j // pp. So chunk c of
stage s holds the global layers

    [(c * pp + s) * L / (pp * vpp), (c * pp + s + 1) * L / (pp * vpp))

which is megatron-core's `get_transformer_layer_offset` for an even split
(offset = vp_stage * L / vpp + pp_rank * L / (pp * vpp)); the engine checks
its built chunks against it. The embedding is the first chunk of the first
stage; the final norm and the output layer the last chunk of the last stage.

megatron-core numbers a chunk's layers from 0 (`decoder.layers.N` is local);
the bridge and HF checkpoints number them globally. `local_name` is a
parameter's name on its stage as the engine's `named_params` and checkpoint
shards spell it: at vpp > 1 prefixed by its chunk (`chunk1.decoder.layers.0...`),
as a rank then holds several GPTModels whose names would collide.

Everything that maps layers to ranks uses this module: the engine's
`stage_entries`, the 3D-HybridEngine's reshard and apart plans, the reshard
tool's hybridflow reader and writer. Pure Python; the config checks that
pp * vpp divides the layers (`config/validate.py`), naming the key.
"""
from __future__ import annotations

import re
from typing import Optional

LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
CHUNK = re.compile(r"^chunk(\d+)\.(.*)$")


def layers_per_chunk(layers: int, pp: int, vpp: int = 1) -> int:
    if pp < 1 or vpp < 1 or layers % (pp * vpp):
        raise ValueError(f"pp*vpp = {pp}*{vpp} must divide the {layers} layers")
    return layers // (pp * vpp)


def layer_place(layer: int, layers: int, pp: int, vpp: int = 1) -> tuple[int, int]:
    """(stage, chunk) holding global decoder layer `layer`."""
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} is outside the model's {layers}")
    block = layer // layers_per_chunk(layers, pp, vpp)
    return block % pp, block // pp


def chunk_layers(stage: int, chunk: int, layers: int, pp: int, vpp: int = 1) -> range:
    """The global layers of chunk `chunk` of stage `stage`, in order."""
    per = layers_per_chunk(layers, pp, vpp)
    first = (chunk * pp + stage) * per
    return range(first, first + per)


def stage_layers(stage: int, layers: int, pp: int, vpp: int = 1) -> list[int]:
    """Every global layer on `stage`, chunk by chunk."""
    return [i for c in range(vpp) for i in chunk_layers(stage, c, layers, pp, vpp)]


def layer_index(megatron_name: str) -> Optional[int]:
    match = LAYER.match(megatron_name)
    return int(match[1]) if match else None


def param_place(megatron_name: str, layers: int, pp: int, vpp: int = 1) -> tuple[int, int]:
    """(stage, chunk) holding a parameter, by its global megatron name."""
    index = layer_index(megatron_name)
    if index is not None:
        return layer_place(index, layers, pp, vpp)
    return (0, 0) if megatron_name.startswith("embedding.") else (pp - 1, vpp - 1)


def param_stage(megatron_name: str, layers: int, pp: int, vpp: int = 1) -> int:
    return param_place(megatron_name, layers, pp, vpp)[0]


def chunk_name(chunk: int, name: str, vpp: int = 1) -> str:
    """A chunk's own parameter name as the stage spells it (prefixed by the chunk at vpp > 1)."""
    return f"chunk{chunk}.{name}" if vpp > 1 else name


def local_name(megatron_name: str, layers: int, pp: int, vpp: int = 1) -> str:
    """A parameter's name on its stage: its chunk's layers numbered from 0, its chunk named at vpp > 1."""
    stage, chunk = param_place(megatron_name, layers, pp, vpp)
    match = LAYER.match(megatron_name)
    if match is not None:
        local = int(match[1]) - chunk_layers(stage, chunk, layers, pp, vpp).start
        megatron_name = f"decoder.layers.{local}.{match[2]}"
    return chunk_name(chunk, megatron_name, vpp)


def chunks_in(names) -> int:
    """vpp of a stage's parameter names (`local_name`'s spelling): the chunks they name, 1 without any."""
    found = [int(m[1]) for n in names if (m := CHUNK.match(n))]
    return max(found) + 1 if found else 1


def layout_label(dims, virtual_pp: int = 1, ep: int = 1) -> str:
    """The layout a role's shards are written at, as trainer.json records it: "p2-t1-d1", "-v2" appended
    for 2 model chunks per stage, "-e2" for experts split over 2 ranks (the shards then hold other names or
    other tensors: a resume compares the labels)."""
    return str(dims) + (f"-v{virtual_pp}" if virtual_pp > 1 else "") + (f"-e{ep}" if ep > 1 else "")
