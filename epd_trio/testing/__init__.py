"""Test doubles shipped with the package: the fake vLLM server and an in-process cluster."""

from .cluster import Cluster as Cluster
from .cluster import Fleet as Fleet
from .cluster import run_cluster as run_cluster
from .cluster import run_fleet as run_fleet
from .cluster import run_moriio_cluster as run_moriio_cluster
from .cluster import serve_proxy as serve_proxy
from .fake_kv import KVConfig as KVConfig
from .fake_vllm import Behaviour as Behaviour
from .fake_vllm import FakeVLLM as FakeVLLM
from .fake_vllm import Received as Received
from .kv_publisher import KVEventPublisher as KVEventPublisher

__all__ = ["Behaviour", "Cluster", "FakeVLLM", "Fleet", "KVConfig", "KVEventPublisher", "Received",
           "run_cluster", "run_fleet", "run_moriio_cluster", "serve_proxy"]
