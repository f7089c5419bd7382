"""The links between GPUs, and the KV transfer bill of prefill/decode disaggregation: the bytes a
request's K and V take, and how long they take to cross a link (chapter 06).

A request prefilled on one GPU and decoded on another must move the K and V of its whole prompt:
kv_bytes_per_token x prompt tokens. DistServe (Zhong et al., OSDI 2024) puts a 512-token OPT-66B
request at about 1.13 GB (1.13 GiB: 1.21e9 bytes in fp16); `kv_transfer_bill` prices it on each
link. A link's rate here is what one GPU can send one way: datasheets quote NVLink and PCIe as the
sum of both directions, so a one-way transfer gets half of it; network rates are per direction.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from infra_lab.hardware import Device
from infra_lab.model.config import ModelConfig
from infra_lab.model.cost import kv_bytes_per_token

GB = 1e9  # decimal, as datasheets
GIB = 2**30
LINK_LATENCY_S = 10e-6  # an assumption, not a measurement: setting up one transfer (a round trip through a
# switch or the driver); it is microseconds against the milliseconds a request's K and V take on any link here


@dataclass(frozen=True)
class Link:
    name: str
    datasheet_bytes_per_s: float  # as quoted
    both_directions: bool  # the datasheet figure sums both directions (NVLink, PCIe)
    source: str
    latency_s: float = LINK_LATENCY_S

    @property
    def bytes_per_s(self) -> float:
        """What one GPU can send one way (bytes/s)."""
        return self.datasheet_bytes_per_s / (2 if self.both_directions else 1)

    def seconds(self, nbytes: float, lanes: int = 1) -> float:
        """Time to send `nbytes` over `lanes` such links side by side (a tensor-parallel instance
        sends each GPU's shard of the K and V over its own link): latency + bytes / (lanes x rate)."""
        if not nbytes >= 0:
            raise ValueError(f"nbytes must be >= 0; got {nbytes}")
        if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
            raise ValueError(f"lanes must be an integer >= 1; got {lanes!r}")
        return self.latency_s + nbytes / (lanes * self.bytes_per_s)


NVLINK_A100 = Link("NVLink 3 (A100)", 600 * GB, True, "NVIDIA A100 datasheet (2021): NVLink 600 GB/s, "
                   "12 links of 25 GB/s each way")
NVLINK_H100 = Link("NVLink 4 (H100)", 900 * GB, True, "NVIDIA H100 datasheet (2023), SXM: NVLink 900 GB/s, "
                   "18 links of 25 GB/s each way")
PCIE3_X16 = Link("PCIe 3.0 x16", 32 * GB, True, "NVIDIA T4 datasheet (2019): PCIe Gen3 x16, 32 GB/s")
PCIE4_X16 = Link("PCIe 4.0 x16", 64 * GB, True, "NVIDIA A100 datasheet (2021): PCIe Gen4 64 GB/s "
                 "(16 GT/s x 16 lanes, both ways)")
PCIE5_X16 = Link("PCIe 5.0 x16", 128 * GB, True, "NVIDIA H100 datasheet (2023): PCIe Gen5 128 GB/s "
                 "(32 GT/s x 16 lanes, both ways)")
INFINITY_FABRIC_MI300X = Link("Infinity Fabric (MI300X)", 896 * GB, True, "AMD Instinct MI300X datasheet "
                              "(2023): 896 GB/s peak Infinity Fabric bandwidth")
NETWORK_100G = Link("100 Gb/s network", 100e9 / 8, False, "100 Gb/s Ethernet or InfiniBand EDR, per "
                    "direction: 12.5 GB/s")
NETWORK_200G = Link("200 Gb/s network", 200e9 / 8, False, "InfiniBand HDR (ConnectX-6), one per GPU in a "
                    "DGX A100, per direction: 25 GB/s")
NETWORK_400G = Link("400 Gb/s network", 400e9 / 8, False, "InfiniBand NDR (ConnectX-7), one per GPU in a "
                    "DGX H100, per direction: 50 GB/s")
INSTANT = Link("instant", math.inf, False, "no link: the decode phase alone, its K and V already there", 0.0)

LINKS: dict[str, Link] = {link.name: link for link in (
    NVLINK_A100, NVLINK_H100, PCIE3_X16, PCIE4_X16, PCIE5_X16, INFINITY_FABRIC_MI300X, NETWORK_100G,
    NETWORK_200G, NETWORK_400G)}

INTRA_NODE: dict[str, Link] = {  # catalog device -> the link between two GPUs of one machine
    "A100 SXM 80GB": NVLINK_A100, "H100 SXM": NVLINK_H100,
    "H200": NVLINK_H100,  # H200 datasheet (2024): NVLink 900 GB/s
    "L4": PCIE4_X16,  # L4 datasheet (2023): PCIe Gen4 x16, no NVLink
    "T4": PCIE3_X16, "MI300X": INFINITY_FABRIC_MI300X,
}


def intra_node_link(device: Device) -> Link:
    """The link tensor parallelism and a same-machine KV transfer use between `device`'s GPUs."""
    if device.name not in INTRA_NODE:
        raise KeyError(f"no intra-node link known for {device.name!r}; known: {', '.join(INTRA_NODE)}")
    return INTRA_NODE[device.name]


def link(name: str) -> Link:
    if name not in LINKS:
        raise KeyError(f"unknown link {name!r}; known links: {', '.join(LINKS)}")
    return LINKS[name]


def request_kv_bytes(config: ModelConfig, prompt_tokens: int, dtype: str = "fp16") -> float:
    """Bytes of K and V a prefilled prompt hands to its decode instance: every layer's K and V for
    every prompt token."""
    if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int) or prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be an integer >= 1; got {prompt_tokens!r}")
    return kv_bytes_per_token(config, dtype) * prompt_tokens


def kv_transfer_bill(config: ModelConfig, prompt_tokens: int, output_tokens: int, decode_step_s: float,
                 links: tuple[Link, ...] = tuple(LINKS.values()), dtype: str = "fp16",
                 lanes: int = 1) -> list[dict]:
    """One request's K and V on each link, against the decode that follows it: one dict per link
    with the bytes (and GiB), the transfer's seconds (over `lanes` links side by side), and how it
    compares with one decode step (`decode_step_s`, seconds) and with the request's whole decode
    (output_tokens - 1 steps). `hides_under_step`: the transfer takes at most one step, so a decode
    instance that pulls it while it runs its batch delays the request's second token by at most
    a step; `hides_under_decode`: it takes less than the request's whole decode, so one link per
    decoding request keeps up with the decodes."""
    if not decode_step_s > 0:
        raise ValueError(f"decode_step_s must be > 0 seconds; got {decode_step_s}")
    if isinstance(output_tokens, bool) or not isinstance(output_tokens, int) or output_tokens < 1:
        raise ValueError(f"output_tokens must be an integer >= 1; got {output_tokens!r}")
    nbytes = request_kv_bytes(config, prompt_tokens, dtype)
    decode_s = (output_tokens - 1) * decode_step_s
    rows = []
    for each in links:
        seconds = each.seconds(nbytes, lanes)
        rows.append({"link": each.name, "source": each.source, "bytes": nbytes, "gib": nbytes / GIB,
                     "one_way_gb_s": each.bytes_per_s / GB, "transfer_s": seconds,
                     "decode_step_s": decode_step_s, "decode_s": decode_s,
                     "steps_of_transfer": seconds / decode_step_s,
                     "hides_under_step": seconds <= decode_step_s, "hides_under_decode": seconds <= decode_s})
    return rows
