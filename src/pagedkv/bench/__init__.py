"""`pagedkv bench`: prefix-heavy workloads measured cold, cached and against an ideal cache."""

from pagedkv.bench.ideal import IdealCache, PrefixTrie
from pagedkv.bench.workloads import WORKLOADS, Step, Workload, build_workload

__all__ = ["WORKLOADS", "IdealCache", "PrefixTrie", "Step", "Workload", "build_workload"]
