"""Engine hosts from an ``InferencePool`` and its ready Pods (Kubernetes API, list + watch).

Pure core: ``PoolState`` applies watch events (the API server's JSON shape:
``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": {...}}``) of the pool and of
its Pods and answers the current endpoints, with no I/O; tests replay recorded streams.
A Pod counts when it matches the pool's ``spec.selector.matchLabels``, has a
``status.podIP``, its ``Ready`` condition is ``True`` and it is not being deleted
(``metadata.deletionTimestamp``); its endpoints are ``podIP:number`` for each
``spec.targetPorts`` entry, named after the Pod (``<pod>`` with one target port,
``<pod>:<number>`` with several).

The shell, ``InferencePoolSource``: two threads with the official ``kubernetes`` client
(imported here, lazily: only this source needs it). One watches the pool (by name); the
other lists the Pods matching the current selector and watches from the list's
``resourceVersion``, resuming from the last one seen after a watch ends; an ``ERROR``
410 (Gone: that version is too old) relists. A selector change restarts the Pod watch.
Every change publishes the whole endpoint set (``extproc.fleet.discovery``).
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Iterable, Mapping

from extproc.fleet.discovery import DiscoveryError, Endpoint, Publish, endpoint_address
from extproc.errors import ConfigError

__all__ = ["GROUP", "PLURAL", "VERSION", "InferencePoolSource", "PoolSpec", "PoolState", "WatchExpired",
           "pod_endpoints", "pool_spec"]

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
GONE = 410
SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class WatchExpired(DiscoveryError):
    """ERROR 410 Gone: the watch's resourceVersion is too old; list again."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    selector: Mapping[str, str]
    ports: tuple[int, ...]

    @property
    def label_selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))


def pool_spec(pool: Mapping[str, Any]) -> PoolSpec:
    """The selector and target ports of an InferencePool object (a dict)."""
    spec = pool.get("spec") or {}
    labels = (spec.get("selector") or {}).get("matchLabels")
    ports = spec.get("targetPorts")
    if not isinstance(labels, dict) or not labels or not isinstance(ports, list) or not ports:
        raise DiscoveryError("InferencePool needs spec.selector.matchLabels and spec.targetPorts")
    try:
        numbers = tuple(int(p["number"]) for p in ports)
    except (KeyError, TypeError, ValueError) as exc:
        raise DiscoveryError(f"InferencePool spec.targetPorts: {exc}") from exc
    return PoolSpec(MappingProxyType({str(k): str(v) for k, v in labels.items()}), numbers)


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_endpoints(pod: Mapping[str, Any], spec: PoolSpec) -> tuple[Endpoint, ...]:
    """The endpoints one Pod gives the pool: none unless it matches, is Ready, has an IP
    and is not being deleted."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    ip = (pod.get("status") or {}).get("podIP")
    if (meta.get("deletionTimestamp") or not ip or not _ready(pod)
            or any(labels.get(k) != v for k, v in spec.selector.items())):
        return ()
    name = meta.get("name", "")
    several = len(spec.ports) > 1
    return tuple(Endpoint(endpoint_address(ip, port), f"{name}:{port}" if several else name)
                 for port in spec.ports)


class PoolState:
    """The pool's spec and its Pods as the watches last said; ``endpoints`` the result."""

    def __init__(self) -> None:
        self.spec: PoolSpec | None = None
        self.pods: dict[str, Mapping[str, Any]] = {}
        self.pod_version: str | None = None      # resume the Pod watch from here
        self.pool_version: str | None = None

    @property
    def endpoints(self) -> frozenset[Endpoint]:
        if self.spec is None:
            return frozenset()
        return frozenset(ep for pod in self.pods.values() for ep in pod_endpoints(pod, self.spec))

    def relist(self, pods: Iterable[Mapping[str, Any]], resource_version: str | None) -> frozenset[Endpoint]:
        """A fresh list replaces every Pod known."""
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.pod_version = resource_version
        return self.endpoints

    def apply_pod(self, event: Mapping[str, Any]) -> frozenset[Endpoint]:
        kind, obj = _event(event)
        if kind in ("ADDED", "MODIFIED"):
            self.pods[obj["metadata"]["name"]] = obj
        elif kind == "DELETED":
            self.pods.pop(obj["metadata"]["name"], None)
        self.pod_version = (obj.get("metadata") or {}).get("resourceVersion") or self.pod_version
        return self.endpoints

    def apply_pool(self, event: Mapping[str, Any]) -> bool:
        """A pool event; True when the selector changed (the Pod watch must restart)."""
        kind, obj = _event(event)
        self.pool_version = (obj.get("metadata") or {}).get("resourceVersion") or self.pool_version
        if kind == "BOOKMARK":
            return False
        old = self.spec
        if kind == "DELETED":
            self.spec = None
        else:
            try:
                self.spec = pool_spec(obj)
            except DiscoveryError as exc:   # a pool we cannot read serves nothing
                log.warning("%s", exc)
                self.spec = None
        return (old.selector if old else None) != (self.spec.selector if self.spec else None)


def _event(event: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    kind = event.get("type")
    obj = event.get("raw_object", event.get("object")) or {}
    if kind == "ERROR":
        if obj.get("code") == GONE:
            raise WatchExpired(obj.get("message") or "resource version too old")
        raise DiscoveryError(f"watch error {obj.get('code')}: {obj.get('message')}")
    if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
        raise DiscoveryError(f"unknown watch event type {kind!r}")
    return kind, obj


class InferencePoolSource:
    """Follows one InferencePool and its Pods with the Kubernetes API (see the module doc).
    ``api``: an ``ApiClient`` (tests); default: in-cluster config, else ~/.kube/config."""

    def __init__(self, name: str, namespace: str | None = None, *, api=None,
                 timeout_s: int = 300, backoff_s: float = 1.0) -> None:
        self.name = name
        self.namespace = namespace or self._own_namespace()
        self.state = PoolState()
        self.timeout_s, self.backoff_s = timeout_s, backoff_s
        self._api = api
        self._publish: Publish | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._spec_changed = threading.Event()
        self._watches: list = []
        self._threads: list[threading.Thread] = []
        self._published: frozenset[Endpoint] | None = None

    @staticmethod
    def _own_namespace() -> str:
        try:
            return SA_NAMESPACE.read_text().strip()
        except OSError:
            return "default"

    def start(self, publish: Publish) -> "InferencePoolSource":
        try:
            from kubernetes import client, config
        except ImportError as exc:
            raise ConfigError("--discovery inferencepool: needs the kubernetes package "
                              "(pip install 'ace[kubernetes]')") from exc
        if self._api is None:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                try:
                    config.load_kube_config()
                except (config.ConfigException, OSError) as exc:
                    raise ConfigError(f"--discovery inferencepool: no Kubernetes API config "
                                      f"(in-cluster or ~/.kube/config): {exc}") from exc
            self._api = client.ApiClient()
        self._core = client.CoreV1Api(self._api)
        self._custom = client.CustomObjectsApi(self._api)
        self._publish = publish
        for target, what in ((self._follow_pool, "pool"), (self._follow_pods, "pods")):
            t = threading.Thread(target=target, name=f"inferencepool-{what}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def _emit(self) -> None:
        endpoints = self.state.endpoints
        if endpoints != self._published:
            self._published = endpoints
            self._publish(endpoints)

    def _watch(self, kind: str, selector: Mapping[str, str] | None = None):
        from kubernetes import watch
        w = watch.Watch()
        w.ace_kind, w.ace_selector = kind, selector
        with self._lock:
            self._watches.append(w)
        return w

    def _forget(self, w) -> None:
        with self._lock:
            self._watches.remove(w)

    def _follow_pool(self) -> None:
        while not self._stop.is_set():
            w = self._watch("pool")
            try:
                for event in w.stream(self._custom.list_namespaced_custom_object, GROUP, VERSION,
                                      self.namespace, PLURAL, field_selector=f"metadata.name={self.name}",
                                      resource_version=self.state.pool_version, allow_watch_bookmarks=True,
                                      timeout_seconds=self.timeout_s, _request_timeout=self.timeout_s + 30):
                    with self._lock:
                        changed = self.state.apply_pool(event)
                        self._emit()
                    if changed:   # the Pod thread lists again with the new selector
                        self._spec_changed.set()
                        selector = self.state.spec.selector if self.state.spec else None
                        self._interrupt(lambda w: w.ace_kind == "pods" and w.ace_selector != selector)
            except Exception as exc:   # API errors, a dropped connection (urllib3), a bad object:
                # the loop must outlive them all; the last hosts stay meanwhile
                self._failed("InferencePool", exc, lambda: setattr(self.state, "pool_version", None))
            finally:
                self._forget(w)

    def _interrupt(self, stale, patience_s: float = 5.0) -> None:
        """End the watches ``stale(w)`` names, even while blocked reading: the response is
        shut down (urllib3 >= 2.3) besides the client's own stop flag. Again until they are
        gone: a watch whose response has not begun yet cannot be shut down."""
        deadline = time.monotonic() + patience_s
        while True:
            with self._lock:
                live = [w for w in self._watches if stale(w)]
                for w in live:
                    w.stop()
                    shutdown = getattr(getattr(w, "_resp", None), "shutdown", None)
                    if shutdown is not None:
                        try:
                            shutdown()
                        except (OSError, RuntimeError, ValueError):   # ended meanwhile, or released
                            pass
            if not live or time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def _list_pods(self, spec: PoolSpec) -> None:
        """List the Pods the selector matches (as JSON, the watch's shape) and replace them."""
        found = self._core.list_namespaced_pod(self.namespace, label_selector=spec.label_selector,
                                               _preload_content=False, _request_timeout=30)
        body = json.loads(found.data)
        with self._lock:
            self.state.relist(body.get("items") or (), (body.get("metadata") or {}).get("resourceVersion"))
            self._emit()

    def _follow_pods(self) -> None:
        relist = True
        while not self._stop.is_set():
            spec = self.state.spec
            if spec is None:
                relist = True
                self._spec_changed.wait(1.0)
                continue
            try:
                if relist or self._spec_changed.is_set():
                    self._spec_changed.clear()
                    self._list_pods(spec)
                    relist = False
                w = self._watch("pods", spec.selector)
                try:
                    if self._spec_changed.is_set():   # changed after the spec was read: the
                        continue                      # pool thread may have missed this watch
                    for event in w.stream(self._core.list_namespaced_pod, self.namespace,
                                          label_selector=spec.label_selector,
                                          resource_version=self.state.pod_version, allow_watch_bookmarks=True,
                                          timeout_seconds=self.timeout_s, _request_timeout=self.timeout_s + 30):
                        if self._spec_changed.is_set():
                            break
                        with self._lock:
                            self.state.apply_pod(event)
                            self._emit()
                finally:
                    self._forget(w)
            except Exception as exc:   # as in _follow_pool
                relist = True
                if not (self._spec_changed.is_set() or self._stop.is_set()):   # else: interrupted on purpose
                    self._failed("Pods", exc, lambda: None)

    def _failed(self, what: str, exc: Exception, reset) -> None:
        gone = isinstance(exc, WatchExpired) or getattr(exc, "status", None) == GONE
        if gone:
            log.info("inferencepool %s/%s: %s watch expired, listing again", self.namespace, self.name, what)
            reset()
            return
        if not self._stop.is_set():
            log.warning("inferencepool %s/%s: %s watch failed: %s; keeping the last hosts",
                        self.namespace, self.name, what, exc)
        reset()
        self._stop.wait(self.backoff_s)

    def close(self) -> None:
        self._stop.set()
        self._spec_changed.set()
        self._interrupt(lambda w: True, patience_s=2.0)
        for t in self._threads:
            t.join(timeout=2)
