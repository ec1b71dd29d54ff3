"""Scenario files: a simulated cluster, its network, and what to sweep, in TOML.

A scenario names a master, workers (listed, and/or a random population), the network, the
non-convolutional time of a step, and the grid to sweep (cluster sizes, bandwidths, networks,
batch sizes, share policies). The shipped ones live in ``simulations/scenarios/`` and say in
comments where every number comes from. The format, every key optional unless marked::

    name = "cpu-cluster"                 # default: the file's stem
    description = "one line for --list"
    paper = true                         # the reference paper's own setup: the output checks
                                         # the bandwidth against the paper's volume formula

    [network]
    kind = "wifi"                        # required: "wifi" (one shared medium) or "switched"
    bandwidth_mbps = 5.0                 # required: Wi-Fi medium / every port, Mbit/s goodput
    latency_ms = 2.0                     # round trip master <-> worker (default 0)

    [sweep]
    nodes = [1, 2, 4, 8]                 # required: cluster sizes, master included
    networks = ["paper-500-1500"]        # required: presets or .json spec files
    batches = [64]                       # required
    bandwidth_mbps = [1, 5, 100]         # default: [network.bandwidth_mbps]
    policies = ["compute", "link"]       # default: both

    [master]                             # required
    name = "i7-6700HQ"
    gflops = 133                         # convolution throughput; or probe_ms = ... (the figure
                                         # `hetconv devices` prints), one of the two required
    layer_gflops = { conv1 = 30 }        # per-layer override
    compute = true                       # the master computes a share
    bandwidth_mbps = 1000                # switched: the master's port (default: the network's)

    [[workers]]                          # devices in the order clusters grow; repeatable
    name = "i5-3210M"
    gflops = 32                          # or probe_ms
    count = 1                            # this many identical ones
    bandwidth_mbps = 5                   # its own link (default: the network's)
    latency_ms = 2

    [population]                         # more workers, speeds ~ Gaussian, clipped to the range
    slowest_gflops = 32                  # required
    fastest_gflops = 133                 # required
    sigma = 0.25                         # standard deviation as a fraction of the range
    seed = 1
    count = 100                          # default: as many as the largest cluster needs

    [layer_efficiency]                   # a layer's throughput relative to a device's gflops
    conv1 = 0.2

    [comp]                               # the master's non-conv seconds per step, per network:
    "paper-50-500" = { per_image_ms = 5.0, fixed_ms = 0 }   # fixed + batch x per image
    "paper-500-1500" = { conv_fraction = 0.8 }   # or: convolutions' share of a local step

    [wire]
    bundle_call_ms = 0.75                # fixed cost of a one-message call
    stream_call_ms = 2.5                 # fixed cost of a streamed call
    software_gbytes_per_s = 0.75         # what the master's side of the wire moves at most
    sum_gbytes_per_s = 5.0               # the master's summing of input-gradient parts
    compute_stall = 0.0                  # streamed transfers' rate lost while the master
                                         # computes (0..1; see costmodel.WireCosts)
    format = "float32"                   # activations on the wire: float32, float16 or
                                         # bfloat16 (hetconv train --wire-format)

Networks not listed in ``[comp]`` use :data:`DEFAULT_COMP_MS_PER_IMAGE` (measured here);
:meth:`Scenario.with_paper_comp` replaces them all by the paper's reported shares
(``hetconv simulate --comp paper``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hetconv.backends import AUTO_PROBE
from hetconv.balance import POLICIES
from hetconv.costmodel import FABRICS, MBIT, WIFI, SimCluster, SimNode, WireCosts
from hetconv.formats import FORMAT_LABELS, format_named
from hetconv.onnx_import import load_network

from .paper import paper_comp_fraction

SCENARIO_DIR = Path(__file__).parent / "scenarios"
#: The largest cluster a sweep may ask for (``hetconv simulate --nodes`` has the same bound).
MAX_NODES = 1024

#: The master's non-convolutional time per image (ms) when a scenario gives none: hetconv's own
#: numpy layers (ReLU, LRN, pooling, FC, loss, SGD) measured on this project's 2-vCPU machine
#: with ``hetconv train --local --trace`` at batch 16 and 64 (``comp_seconds`` / batch; spread
#: ±30 % between runs on this shared machine).
DEFAULT_COMP_MS_PER_IMAGE = {
    "tiny": 0.2,
    "paper-50-500": 5.0,
    "paper-150-800": 12.0,
    "paper-300-1000": 24.0,
    "paper-500-1500": 40.0,
}


def probe_gflops(probe_ms: float) -> float:
    """Throughput from the probe figure ``hetconv devices`` / ``hetconv worker`` print: forward
    + both gradients of :data:`hetconv.backends.AUTO_PROBE` (paper-50-500's C2, batch 8)."""
    return 3 * AUTO_PROBE.flops_forward / (probe_ms * 1e-3) / 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """One device of a scenario: its convolution throughput and, optionally, its own link."""

    name: str
    gflops: float
    layer_gflops: Mapping[str, float] = field(default_factory=dict)
    bandwidth_mbps: float | None = None
    latency_ms: float | None = None


@dataclass(frozen=True)
class Population:
    """Workers drawn at random: throughput ~ N(middle of the range, sigma x range), clipped to
    [slowest, fastest], from a seeded generator (the same seed, the same devices)."""

    slowest_gflops: float
    fastest_gflops: float
    sigma: float = 0.25
    seed: int = 0
    count: int | None = None
    bandwidth_mbps: float | None = None
    latency_ms: float | None = None
    name: str = "device"

    def draw(self, count: int) -> list[DeviceSpec]:
        """The first ``count`` devices (a larger count extends, never changes, a smaller one)."""
        lo, hi = self.slowest_gflops, self.fastest_gflops
        rng = np.random.default_rng(self.seed)
        speeds = np.clip(rng.normal((lo + hi) / 2, self.sigma * (hi - lo), count), lo, hi)
        return [
            DeviceSpec(f"{self.name}-{i + 1}", float(g), {}, self.bandwidth_mbps, self.latency_ms)
            for i, g in enumerate(speeds)
        ]


@dataclass(frozen=True)
class CompFigure:
    """The master's non-convolutional seconds per step for one network: either
    ``fixed + batch x per_image``, or from ``conv_fraction`` of a local step."""

    per_image_s: float | None = None
    fixed_s: float = 0.0
    conv_fraction: float | None = None
    how: str = ""  # where the figure comes from, when not a scenario file (said in its output)

    def seconds(self, batch: int, local_conv_s: float) -> float:
        if self.conv_fraction is not None:
            return local_conv_s * (1 - self.conv_fraction) / self.conv_fraction
        return self.fixed_s + batch * (self.per_image_s or 0.0)


@dataclass(frozen=True)
class Scenario:
    """A simulated cluster and what to sweep over it (see the module docstring)."""

    name: str
    description: str
    fabric: str
    bandwidth_mbps: float
    latency_ms: float
    master: DeviceSpec
    nodes: tuple[int, ...]
    networks: tuple[str, ...]
    batches: tuple[int, ...]
    bandwidths_mbps: tuple[float, ...] = ()
    policies: tuple[str, ...] = POLICIES
    master_compute: bool = True
    workers: tuple[DeviceSpec, ...] = ()
    population: Population | None = None
    comp: Mapping[str, CompFigure] = field(default_factory=dict)
    layer_efficiency: Mapping[str, float] = field(default_factory=dict)
    wire: WireCosts = field(default_factory=WireCosts)
    source: str = ""  # the file it came from
    paper: bool = False  # the reference paper's setup (simulations.paper checks its bandwidth)
    comp_basis: str = "scenario"  # "scenario" ([comp] or measured here) or "paper"

    def sweep_bandwidths(self) -> tuple[float, ...]:
        return self.bandwidths_mbps or (self.bandwidth_mbps,)

    def worker_devices(self, count: int) -> list[DeviceSpec]:
        """The first ``count`` workers: the listed ones, then the population's draws."""
        devices = list(self.workers[:count])
        if len(devices) < count:
            if self.population is None:
                raise ValueError(
                    f"scenario {self.name} lists {len(self.workers)} workers and no [population]"
                    f"; a cluster of {count + 1} nodes needs {count}"
                )
            limit = self.population.count
            drawn = count - len(devices)
            if limit is not None and drawn > limit:
                raise ValueError(
                    f"scenario {self.name}: a cluster of {count + 1} nodes needs {drawn} drawn "
                    f"workers, [population] count is {limit}"
                )
            devices += self.population.draw(drawn)
        return devices

    def max_nodes(self) -> int | None:
        """The largest cluster the scenario can form (None: unbounded)."""
        if self.population is None:
            return 1 + len(self.workers)
        if self.population.count is None:
            return None
        return 1 + len(self.workers) + self.population.count

    def _node(self, device: DeviceSpec, bandwidth_mbps: float, latency_ms: float) -> SimNode:
        layer_gflops = {name: device.gflops * f for name, f in self.layer_efficiency.items()}
        layer_gflops.update(device.layer_gflops)
        return SimNode(
            device.name,
            device.gflops,
            layer_gflops,
            MBIT * (device.bandwidth_mbps or bandwidth_mbps),
            1e-3 * (device.latency_ms if device.latency_ms is not None else latency_ms),
        )

    def cluster(self, nodes: int, bandwidth_mbps: float | None = None) -> SimCluster:
        """The cluster of ``nodes`` nodes (the master and ``nodes - 1`` workers) with the
        network at ``bandwidth_mbps`` (default: the scenario's). Devices that name their own link
        keep it."""
        if nodes < 1:
            raise ValueError(f"a cluster has at least 1 node (the master), got {nodes}")
        bandwidth = bandwidth_mbps or self.bandwidth_mbps
        workers = tuple(
            self._node(d, bandwidth, self.latency_ms) for d in self.worker_devices(nodes - 1)
        )
        return SimCluster(
            master=self._node(self.master, bandwidth, 0.0),
            workers=workers,
            fabric=self.fabric,
            medium_bytes_per_s=MBIT * bandwidth,
            master_compute=self.master_compute,
            wire=self.wire,
        )

    def comp_seconds(self, network: str, batch: int, local_conv_s: float) -> float:
        """The master's non-convolutional seconds of one step of ``network`` at ``batch``."""
        figure = self.comp.get(network)
        if figure is None:
            if network not in DEFAULT_COMP_MS_PER_IMAGE:
                raise ValueError(
                    f"scenario {self.name}: no non-convolutional time for network {network}; "
                    f'add [comp] "{network}" = {{ per_image_ms = ... }}'
                )
            figure = CompFigure(per_image_s=1e-3 * DEFAULT_COMP_MS_PER_IMAGE[network])
        return figure.seconds(batch, local_conv_s)

    def with_paper_comp(self, networks: Sequence[str]) -> Scenario:
        """A copy whose comp for ``networks`` is the paper's reported non-convolutional share of
        a one-device step (:func:`~hetconv.simulations.paper.paper_comp_fraction`), the same at
        every batch, of the master's own convolution time.

        Raises:
            ValueError: a network that is none of the paper's four.
        """
        comp = dict(self.comp)
        for network in networks:
            comp[network] = CompFigure(conv_fraction=1 - paper_comp_fraction(network))
        return replace(self, comp=comp, comp_basis="paper")

    def with_overrides(self, **changes) -> Scenario:
        """A copy with some fields replaced (command-line overrides)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


# -- reading TOML --------------------------------------------------------------------------------


def _toml():
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    try:
        import tomli
    except ModuleNotFoundError:
        raise RuntimeError(
            "reading scenario files on Python 3.10 needs tomli: pip install tomli"
        ) from None
    return tomli


class _Reader:
    """Checks one table of a scenario file, naming file and key in every error."""

    def __init__(self, path: str, section: str, table: object, allowed: Sequence[str]):
        self.path, self.section = path, section
        if not isinstance(table, dict):
            self.fail("", f"must be a table, got {table!r}")
        unknown = sorted(set(table) - set(allowed))
        if unknown:
            where = f"[{section}] " if section else ""
            raise ValueError(
                f"{path}: unknown key {where}{unknown[0]!r}; expected one of "
                f"{', '.join(sorted(allowed))}"
            )
        self.table = table

    def fail(self, key: str, message: str):
        where = f"[{self.section}] {key}" if self.section else key
        raise ValueError(f"{self.path}: {where.strip()} {message}")

    def has(self, key: str) -> bool:
        return key in self.table

    def number(self, key: str, default=None, minimum: float = 0.0, strict: bool = True):
        if key not in self.table:
            if default is ...:
                self.fail(key, "is required")
            return default
        value = self.table[key]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and (value > minimum if strict else value >= minimum)
        if not ok:
            bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
            self.fail(key, f"must be a number {bound}, got {value!r}")
        return float(value)

    def integer(self, key: str, default=None, minimum: int = 1):
        if key not in self.table:
            if default is ...:
                self.fail(key, "is required")
            return default
        value = self.table[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            self.fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def text(self, key: str, default=None, choices: Sequence[str] | None = None):
        if key not in self.table:
            if default is ...:
                self.fail(key, "is required")
            return default
        value = self.table[key]
        if not isinstance(value, str) or (choices is not None and value not in choices):
            expected = f"one of {', '.join(choices)}" if choices else "a string"
            self.fail(key, f"must be {expected}, got {value!r}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.table.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {value!r}")
        return value

    def items(self, key: str, kind: str, default=None, **bounds) -> tuple:
        """A non-empty list whose every element passes ``kind`` (number, integer, text)."""
        if key not in self.table:
            if default is ...:
                self.fail(key, "is required")
            return default
        values = self.table[key]
        if not isinstance(values, list) or not values:
            self.fail(key, f"must be a non-empty list, got {values!r}")
        out = []
        for value in values:
            element = _Reader(self.path, self.section, {key: value}, (key,))
            try:
                out.append(getattr(element, kind)(key, ..., **bounds))
            except ValueError as e:
                raise ValueError(str(e).replace(f"{key} must", f"{key} entries must")) from None
        return tuple(out)

    def numbers_table(self, key: str) -> dict[str, float]:
        if key not in self.table:
            return {}
        table = self.table[key]
        if not isinstance(table, dict):
            self.fail(key, f"must be a table of numbers, got {table!r}")
        reader = _Reader(self.path, f"{self.section}.{key}".strip("."), table, list(table))
        return {name: reader.number(name, ...) for name in table}


_DEVICE_KEYS = ("name", "gflops", "probe_ms", "layer_gflops", "bandwidth_mbps", "latency_ms")


def _device(reader: _Reader, default_name: str) -> DeviceSpec:
    if reader.has("gflops") == reader.has("probe_ms"):
        reader.fail("", "needs exactly one of gflops or probe_ms")
    gflops = reader.number("gflops") or probe_gflops(reader.number("probe_ms"))
    return DeviceSpec(
        name=reader.text("name", default_name),
        gflops=gflops,
        layer_gflops=reader.numbers_table("layer_gflops"),
        bandwidth_mbps=reader.number("bandwidth_mbps"),
        latency_ms=reader.number("latency_ms", strict=False),
    )


def _comp(path: str, table: dict) -> dict[str, CompFigure]:
    out = {}
    for network, entry in table.items():
        reader = _Reader(
            path, f"comp.{network}", entry, ("per_image_ms", "fixed_ms", "conv_fraction")
        )
        if reader.has("conv_fraction") == reader.has("per_image_ms"):
            reader.fail("", "needs exactly one of per_image_ms or conv_fraction")
        fraction = reader.number("conv_fraction")
        if fraction is not None and not fraction < 1:
            reader.fail("conv_fraction", f"must be below 1, got {fraction}")
        per_image = reader.number("per_image_ms", strict=False)
        out[network] = CompFigure(
            per_image_s=None if per_image is None else 1e-3 * per_image,
            fixed_s=1e-3 * reader.number("fixed_ms", 0.0, strict=False),
            conv_fraction=fraction,
        )
    return out


def _workers(path: str, workers: object) -> list[DeviceSpec]:
    """The listed workers (``[[workers]]``), each ``count`` times."""
    if not isinstance(workers, list):
        raise ValueError(f"{path}: workers must be an array of tables ([[workers]])")
    devices: list[DeviceSpec] = []
    for i, entry in enumerate(workers):
        reader = _Reader(path, f"workers.{i}", entry, (*_DEVICE_KEYS, "count"))
        device = _device(reader, f"worker-{i + 1}")
        count = reader.integer("count", 1)
        devices += [
            device if count == 1 else replace(device, name=f"{device.name}#{j + 1}")
            for j in range(count)
        ]
    return devices


def _population(path: str, table: object) -> Population:
    """The ``[population]`` table."""
    pop = _Reader(
        path,
        "population",
        table,
        (
            "slowest_gflops", "fastest_gflops", "sigma", "seed", "count", "bandwidth_mbps",
            "latency_ms", "name",
        ),
    )  # fmt: skip
    population = Population(
        slowest_gflops=pop.number("slowest_gflops", ...),
        fastest_gflops=pop.number("fastest_gflops", ...),
        sigma=pop.number("sigma", 0.25, strict=False),
        seed=pop.integer("seed", 0, minimum=0),
        count=pop.integer("count", None, minimum=0),
        bandwidth_mbps=pop.number("bandwidth_mbps"),
        latency_ms=pop.number("latency_ms", strict=False),
        name=pop.text("name", "device"),
    )
    if population.fastest_gflops < population.slowest_gflops:
        pop.fail("fastest_gflops", "must be at least slowest_gflops")
    return population


def _wire(path: str, table: object) -> WireCosts:
    """The ``[wire]`` table; what it leaves out, the cost model's defaults."""
    reader = _Reader(
        path,
        "wire",
        table,
        (
            "bundle_call_ms",
            "stream_call_ms",
            "software_gbytes_per_s",
            "sum_gbytes_per_s",
            "compute_stall",
            "format",
        ),
    )
    defaults = WireCosts()
    stall = reader.number("compute_stall", defaults.compute_stall, strict=False)
    if stall > 1:
        reader.fail("compute_stall", f"must be at most 1, got {stall:g}")
    return WireCosts(
        bundle_call_s=1e-3 * reader.number("bundle_call_ms", 1e3 * defaults.bundle_call_s),
        stream_call_s=1e-3 * reader.number("stream_call_ms", 1e3 * defaults.stream_call_s),
        software_bytes_per_s=1e9
        * reader.number("software_gbytes_per_s", defaults.software_bytes_per_s / 1e9),
        sum_bytes_per_s=1e9 * reader.number("sum_gbytes_per_s", defaults.sum_bytes_per_s / 1e9),
        compute_stall=stall,
        format=format_named(reader.text("format", defaults.format.label, list(FORMAT_LABELS))),
    )


def parse_scenario(data: dict, path: str = "<scenario>") -> Scenario:
    """A :class:`Scenario` from a parsed TOML document.

    Raises:
        ValueError: naming the file and the key that is unknown, missing or wrong.
    """
    sections = ("network", "sweep", "master", "workers", "population", "comp")
    top = _Reader(
        path, "", data, ("name", "description", "paper", *sections, "layer_efficiency", "wire")
    )
    for section in ("network", "sweep", "master"):
        if section not in data:
            raise ValueError(f"{path}: missing required table [{section}]")
    net = _Reader(path, "network", data["network"], ("kind", "bandwidth_mbps", "latency_ms"))
    sweep = _Reader(
        path, "sweep", data["sweep"], ("nodes", "networks", "batches", "bandwidth_mbps", "policies")
    )
    master = _Reader(path, "master", data["master"], (*_DEVICE_KEYS, "compute"))
    if master.has("latency_ms"):
        master.fail("latency_ms", "is not used: give each worker's round trip to the master")
    devices = _workers(path, data.get("workers", []))
    population = _population(path, data["population"]) if "population" in data else None
    efficiency = top.numbers_table("layer_efficiency")
    wire = _wire(path, data.get("wire", {}))
    comp_table = data.get("comp", {})
    if not isinstance(comp_table, dict):
        raise ValueError(f"{path}: [comp] must be a table of networks")
    networks = sweep.items("networks", "text", ...)
    for network in networks:
        try:
            load_network(network)
        except ValueError as e:
            sweep.fail("networks", f"names an unknown network: {e}")
    scenario = Scenario(
        name=top.text("name", Path(path).stem),
        description=top.text("description", ""),
        fabric=net.text("kind", ..., choices=FABRICS),
        bandwidth_mbps=net.number("bandwidth_mbps", ...),
        latency_ms=net.number("latency_ms", 0.0, strict=False),
        master=_device(master, "master"),
        master_compute=master.flag("compute", True),
        nodes=sweep.items("nodes", "integer", ...),
        networks=networks,
        batches=sweep.items("batches", "integer", ...),
        bandwidths_mbps=sweep.items("bandwidth_mbps", "number", ()),
        policies=sweep.items("policies", "text", POLICIES, choices=POLICIES),
        workers=tuple(devices),
        population=population,
        comp=_comp(path, comp_table),
        layer_efficiency=efficiency,
        wire=wire,
        source=path,
        paper=top.flag("paper", False),
    )
    if scenario.fabric == WIFI and master.has("bandwidth_mbps"):
        master.fail("bandwidth_mbps", "is for a switched network; Wi-Fi shares one medium")
    largest, limit = max(scenario.nodes), scenario.max_nodes()
    if largest > MAX_NODES:
        sweep.fail("nodes", f"asks for {largest} nodes; at most {MAX_NODES} can be simulated")
    if limit is not None and largest > limit:
        sweep.fail("nodes", f"asks for {largest} nodes; the scenario has {limit} devices")
    return scenario


def load_scenario(name_or_path: str) -> Scenario:
    """A shipped scenario by name (``cpu-cluster``) or a scenario file by path.

    Raises:
        ValueError: an unknown name, an unreadable file, invalid TOML, or a bad key (named).
    """
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        shipped = SCENARIO_DIR / f"{name_or_path}.toml"
        if not shipped.is_file():
            names = ", ".join(shipped_scenarios()) or "none"
            raise ValueError(f"no scenario {name_or_path!r}: shipped ones are {names}")
        path = shipped
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read scenario {path}: {e.strerror or e}") from None
    try:
        data = _toml().loads(text)
    except ValueError as e:  # TOMLDecodeError is a ValueError
        raise ValueError(f"{path}: not valid TOML: {e}") from None
    return parse_scenario(data, str(path))


def shipped_scenarios() -> dict[str, str]:
    """Name -> one-line description of every shipped scenario."""
    out = {}
    for path in sorted(SCENARIO_DIR.glob("*.toml")):
        scenario = load_scenario(str(path))
        out[path.stem] = scenario.description
    return out


__all__ = [
    "DEFAULT_COMP_MS_PER_IMAGE",
    "CompFigure",
    "DeviceSpec",
    "Population",
    "Scenario",
    "load_scenario",
    "parse_scenario",
    "probe_gflops",
    "shipped_scenarios",
]
