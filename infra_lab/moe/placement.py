"""Expert placement: replicate the hot experts and spread the replicas so that every GPU gets
about the same load, in the spirit of DeepSeek's EPLB (deepseek-ai/EPLB, README).

The input is each expert's load, measured (tokens routed to it). The hierarchical policy, for
experts in groups (DeepSeek-V3 routes each token within a few groups) and GPUs in nodes:
1. pack the expert groups onto the nodes, the same number each, balancing the nodes' loads;
2. within each node, give the node's extra replica slots one at a time to the expert whose load
   per replica is then highest;
3. pack each node's replicas onto its GPUs, the same number each, balancing the GPUs' loads.
Both packings are greedy, heaviest item first, each into the lightest pack that still has room
(ties: the lower index). With one group and one node this is the global policy. A replica serves
an even share of its expert's tokens.
"""
from __future__ import annotations

import numbers
from typing import NamedTuple

import numpy as np


def balanced_packing(weights: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """weights (n,) into `packs` packs of n / packs items: (pack of each item, its rank in the
    pack, in the order items were placed)."""
    n = len(weights)
    per_pack = n // packs
    pack_of, rank_in_pack = np.empty(n, np.int64), np.empty(n, np.int64)
    loads, sizes = np.zeros(packs), np.zeros(packs, np.int64)
    for item in np.argsort(-np.asarray(weights, np.float64), kind="stable"):  # heaviest first
        open_loads = np.where(sizes < per_pack, loads, np.inf)
        pack = int(np.argmin(open_loads))  # the lightest pack with room, the lower one on ties
        pack_of[item], rank_in_pack[item] = pack, sizes[pack]
        loads[pack] += weights[item]
        sizes[pack] += 1
    return pack_of, rank_in_pack


def replicate(weights: np.ndarray, slots: int) -> tuple[np.ndarray, np.ndarray]:
    """(slot -> expert (slots,), replicas per expert (n,)): every expert once, then each extra
    slot to the expert with the most load per replica (the lower index on ties)."""
    weights = np.asarray(weights, np.float64)
    counts = np.ones(len(weights), np.int64)
    extra = []
    for _ in range(slots - len(weights)):
        expert = int(np.argmax(weights / counts))
        extra.append(expert)
        counts[expert] += 1
    return np.concatenate([np.arange(len(weights)), np.asarray(extra, np.int64)]), counts


class Placement(NamedTuple):
    slot_expert: np.ndarray  # (layers, replicas): the logical expert in each physical slot; GPU g holds
    # slots g * replicas / gpus onward
    replicas: np.ndarray  # (layers, experts): copies of each expert


def _check(loads, replicas, groups, nodes, gpus) -> np.ndarray:
    loads = np.asarray(loads, np.float64)
    if loads.ndim != 2 or (loads < 0).any():
        raise ValueError(f"loads must be (layers, experts), none negative; got shape {loads.shape}")
    for name, value in (("replicas", replicas), ("groups", groups), ("nodes", nodes), ("gpus", gpus)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
    experts = loads.shape[1]
    rules = [(experts % groups == 0, f"{groups} groups must divide the {experts} experts"),
             (groups % nodes == 0, f"{nodes} nodes must divide the {groups} groups"),
             (gpus % nodes == 0, f"{nodes} nodes must divide the {gpus} GPUs"),
             (replicas % gpus == 0, f"{gpus} GPUs must divide the {replicas} replicas"),
             (replicas >= experts, f"{replicas} replicas cannot hold the {experts} experts once each")]
    for holds, message in rules:
        if not holds:
            raise ValueError(message)
    return loads


def place(loads, replicas: int, groups: int = 1, nodes: int = 1, gpus: int = 1) -> Placement:
    """The hierarchical placement of every layer's experts, from loads (layers, experts)."""
    loads = _check(loads, replicas, groups, nodes, gpus)
    layers, experts = loads.shape
    slot_expert = np.empty((layers, replicas), np.int64)
    copies = np.zeros((layers, experts), np.int64)
    per_group, node_slots, node_gpus = experts // groups, replicas // nodes, gpus // nodes
    for layer, weights in enumerate(loads):
        group_node, group_rank = balanced_packing(weights.reshape(groups, per_group).sum(1), nodes)
        for node in range(nodes):  # the node's groups in the order they were packed, experts in order
            mine = sorted(np.flatnonzero(group_node == node), key=lambda g: group_rank[g])
            logical = np.concatenate([np.arange(g * per_group, (g + 1) * per_group) for g in mine])
            slot_logical, counts = replicate(weights[logical], node_slots)
            copies[layer, logical] = counts
            gpu_of, rank_on_gpu = balanced_packing(weights[logical][slot_logical] / counts[slot_logical], node_gpus)
            ordered = np.lexsort((rank_on_gpu, gpu_of))  # slots GPU by GPU, in packing order
            slot_expert[layer, node * node_slots:(node + 1) * node_slots] = logical[slot_logical[ordered]]
    return Placement(slot_expert, copies)


def gpu_loads(loads, placement: Placement, gpus: int) -> np.ndarray:
    """(layers, gpus): each GPU's share of the tokens, every replica serving an even share of its
    expert's load."""
    loads = np.asarray(loads, np.float64)
    per_slot = np.take_along_axis(loads / placement.replicas, placement.slot_expert, axis=1)  # (layers, replicas)
    return per_slot.reshape(loads.shape[0], gpus, -1).sum(2)


def contiguous_loads(loads, gpus: int) -> np.ndarray:
    """(layers, gpus): the loads with no replicas, experts split in contiguous runs, as plain expert
    parallelism places them."""
    loads = np.asarray(loads, np.float64)
    if loads.shape[1] % gpus:
        raise ValueError(f"{gpus} GPUs cannot split the {loads.shape[1]} experts into contiguous runs")
    return loads.reshape(loads.shape[0], gpus, -1).sum(2)
