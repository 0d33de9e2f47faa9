"""The file tier of the prefix cache (--hicache-storage-backend file): below the host tier, a directory of files that
outlives the server, so a restarted server (or the next one on the same directory) hits the prefixes an earlier one
computed.

What is stored is what the host tier holds, in the same (the device pools') row formats: one file per page of a
cached prefix (every compressed layer's entries and indexer keys of the page's tokens) and one per prefix end (its
window tail and CSA staging rows). A page's file is named by the chain hash of the token prefix it ends (each page's
hash covers the hash before it and its own tokens), so it can only be read back for exactly that prefix; an end's
file by that hash and, under speculative decoding, the token its last MTP row was computed with. Files live in a
subdirectory named by the pool layout signature (page size, every buffer's dtype and row shape, the window, the
model's path): a server with another model, entry format or page size never sees them. Every file carries a header
(magic, layout and key digests, payload length, CRC32); one that does not check out is a miss, logged and deleted.

When files are written: whenever the host tier takes a copy (its write policy decides when; a file already present
is not written again), on a writer thread, so the step that made the copy does not wait for the disk. Writes go to
a temporary name and are renamed into place, so a reader never sees a partial file. The directory is bounded
(`max_size_gb`): the least recently used files are deleted past it.
When files are read: while a request waits in the queue, on a reader thread, never on the scheduler's
(mem_cache/file_prefetch.py): the chain hashes of its tokens are computed there too; its walk down the tree goes on
past the tree's path (after a restart: all of it) page by page through the files, up to the deepest end file it
reaches (or to an end file of a node the tree holds without an end on either tier); those pages and that end are
read into host slots reserved for the request, join the tree as a host-only node once landed, and go on to the
device at its admission as any host hit. Waiting requests that share a prefix on file share its reads: each file is
read once, into one set of slots, and what landed serves them all.
--hicache-storage-prefetch-policy (upstream's names) says when a request waiting for reads is admitted:
- best_effort: whenever the scheduler would anyway, with what has landed; room in the host tier is made only by
  dropping copies the device also holds (no cached prefix is lost to read the files), the reads stopping where that
  is not enough;
- wait_complete: once its reads have landed; the host tier's least recently used copies are evicted to read the
  whole match;
- timeout: as wait_complete, but no later than `prefetch_timeout_base` seconds after it was queued (the reads stop
  there too), with the deepest end reached.
Reads still to come when the request is admitted or aborted are cancelled and their slots freed, unless another
waiting request waits on them too.
/flush_cache leaves the files (as upstream, whose storage tier is cleared on its own); a weight update deletes this
layout's files, whose KV the old weights computed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

from sglang.srt.arg_groups.cli import HICACHE_STORAGE_PREFETCH_POLICIES as PREFETCH_POLICIES
from sglang.srt.mem_cache.file_prefetch import FilePrefetcher
from sglang.srt.mem_cache.radix_cache import TreeNode

logger = logging.getLogger(__name__)

_MAGIC = b"DSV4KVF1"
_HEADER = struct.Struct("<8s32s32sQI")  # magic, layout digest, key digest, payload bytes, CRC32 of the payload
_EXTRA_KEYS = ("storage_dir", "max_size_gb", "prefetch_timeout_base")


@dataclass(frozen=True)
class FileTierConfig:
    """--hicache-storage-backend-extra-config (JSON) for the file backend, with the directory's default."""

    storage_dir: str
    max_size_gb: float = 64.0
    prefetch_timeout_base: float = 1.0  # seconds (timeout policy)

    @classmethod
    def parse(cls, extra_config: Optional[str], default_dir: str) -> "FileTierConfig":
        try:
            extra = json.loads(extra_config) if extra_config else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"--hicache-storage-backend-extra-config is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ValueError("--hicache-storage-backend-extra-config must be a JSON object")
        unknown = sorted(set(extra) - set(_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"--hicache-storage-backend-extra-config: unknown key {unknown[0]!r} (the file backend "
                             f"takes {', '.join(_EXTRA_KEYS)})")
        config = cls(str(extra.get("storage_dir", default_dir)), float(extra.get("max_size_gb", 64.0)),
                     float(extra.get("prefetch_timeout_base", 1.0)))
        if not config.storage_dir:
            raise ValueError("--hicache-storage-backend-extra-config: storage_dir is empty")
        if not 0 < config.max_size_gb < float("inf"):
            raise ValueError(f"--hicache-storage-backend-extra-config: max_size_gb must be positive, got "
                             f"{config.max_size_gb}")
        if not 0 < config.prefetch_timeout_base < float("inf"):
            raise ValueError(f"--hicache-storage-backend-extra-config: prefetch_timeout_base must be positive, got "
                             f"{config.prefetch_timeout_base}")
        return config


def layout_digest(host_pool, model_identity: str) -> bytes:
    """What a file's reader must share with its writer: page size, window, every host buffer's dtype and row shape
    (the device pools' formats), and the model."""
    rows = [(str(h.dtype), tuple(h.shape[1:]), n) for _, h, n in
            host_pool.page_buffers + host_pool.end_buffers + host_pool.state_buffers]
    text = repr((host_pool.device_pool.shape.page_size, host_pool.window, rows, model_identity))
    return hashlib.sha256(text.encode()).digest()


def chain_hashes(start: bytes, tokens: list, page_size: int) -> list:
    """The chain hash after each whole page of tokens, from the hash before them (b"" at the root)."""
    out, h = [], start
    for i in range(0, len(tokens) - len(tokens) % page_size, page_size):
        h = hashlib.sha256(h + struct.pack(f"<{page_size}q", *tokens[i:i + page_size])).digest()
        out.append(h)
    return out


def node_hashes(node: TreeNode, page_size: int) -> list:
    """The chain hash after each page of a tree node (kept on the node, split with it: computed once per node)."""
    path = []
    while node.parent is not None and node.page_hashes is None:  # up to the root or a node already hashed
        path.append(node)
        node = node.parent
    start = node.page_hashes[-1] if node.parent is not None else b""
    for n in reversed(path):
        n.page_hashes = chain_hashes(start, n.key, page_size)
        start = n.page_hashes[-1]
    return (path[0] if path else node).page_hashes


def end_key(page_hash: bytes, next_token: Optional[int]) -> bytes:
    return hashlib.sha256(page_hash + (b"end" if next_token is None else struct.pack("<q", next_token))).digest()


class FileStore:
    """Files keyed by digest in one directory, bounded by bytes, least recently used deleted first; the index of what
    is there is read at start and kept as files are written, read and deleted.

    Writes happen behind the caller, on one writer thread (the scheduler's step never waits for the disk): `put`
    records the payload as pending, counted in the index at once (a `get` meanwhile answers from memory), and the
    thread writes it to a temporary name and renames it into place, unless the file was dropped meanwhile. `drain`
    waits for the writes so far (engine shutdown, and at exit)."""

    def __init__(self, root: str, layout: bytes, max_bytes: int) -> None:
        self.layout, self.max_bytes = layout, max_bytes
        self.dir = os.path.join(root, layout.hex()[:32])
        found = []
        try:
            os.makedirs(self.dir, exist_ok=True)
            for entry in os.scandir(self.dir):
                if entry.name.endswith(".kv") and entry.is_file():
                    st = entry.stat()
                    found.append((st.st_mtime, entry.name[:-3], st.st_size))
                elif entry.name.endswith(".tmp"):  # a write cut short by a crash
                    os.unlink(entry.path)
        except OSError as e:
            raise ValueError(f"the file tier cannot use {root!r} ({e}): give SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR "
                             f"or storage_dir in --hicache-storage-backend-extra-config a writable directory") from None
        self.index = OrderedDict((name, size) for _, name, size in sorted(found))  # least recently used first
        self.nbytes = sum(self.index.values())
        self._pending = {}  # name -> file bytes not yet on disk
        self._lock = threading.RLock()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-file-writer")
        atexit.register(self.drain)
        self._evict()

    def __contains__(self, key: bytes) -> bool:
        return key.hex() in self.index

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name + ".kv")

    def put(self, key: bytes, payload: bytes) -> int:
        """Queue a file's write unless it is present; returns the payload bytes queued."""
        name = key.hex()
        with self._lock:
            if name in self.index:
                self.index.move_to_end(name)
                return 0
            data = _HEADER.pack(_MAGIC, self.layout, key, len(payload), zlib.crc32(payload)) + payload
            self._pending[name] = data
            self.index[name] = len(data)
            self.nbytes += len(data)
            self._evict()
        self._writer.submit(self._write, name, data)
        return len(payload)

    def _write(self, name: str, data: bytes) -> None:
        tmp = self._path(name) + f".{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            with self._lock:
                if self._pending.get(name) is data:  # not dropped meanwhile
                    os.replace(tmp, self._path(name))
                    del self._pending[name]
                    return
        except OSError as e:
            logger.warning("file tier: cannot write %s: %s", self._path(name), e)
            with self._lock:
                if self._pending.get(name) is data:
                    self._drop(name)
        with _suppress():
            os.unlink(tmp)

    def drain(self) -> None:
        """Wait for every write queued so far."""
        try:
            self._writer.submit(lambda: None).result()
        except RuntimeError:  # the interpreter is exiting: the executor has already waited for its writes
            pass

    def get(self, key: bytes) -> Optional[bytes]:
        """The payload, or None: absent, unreadable, truncated or corrupt (logged and deleted)."""
        name = key.hex()
        with self._lock:
            if name not in self.index:
                return None
            data = self._pending.get(name)
        if data is None:
            try:
                with open(self._path(name), "rb") as f:
                    data = f.read()
            except OSError as e:
                logger.warning("file tier: cannot read %s: %s", self._path(name), e)
                with self._lock:
                    self._drop(name)
                return None
        problem = None
        if len(data) < _HEADER.size:
            problem = "truncated header"
        else:
            magic, layout, file_key, size, crc = _HEADER.unpack_from(data)
            payload = data[_HEADER.size:]
            if magic != _MAGIC or layout != self.layout or file_key != key:
                problem = "written for another layout or key"
            elif len(payload) != size:
                problem = f"truncated ({len(payload)} of {size} bytes)"
            elif zlib.crc32(payload) != crc:
                problem = "checksum mismatch"
        with self._lock:
            if problem is not None:
                logger.warning("file tier: %s is unusable (%s): a miss; deleted", self._path(name), problem)
                self._drop(name)
                return None
            if name in self.index:
                self.index.move_to_end(name)
        with _suppress():
            os.utime(self._path(name))  # the order survives a restart
        return payload

    def clear(self) -> None:
        self.drain()
        with self._lock:
            for name in list(self.index):
                self._drop(name)

    def _drop(self, name: str) -> None:
        self.nbytes -= self.index.pop(name, 0)
        if self._pending.pop(name, None) is None:
            with _suppress():
                os.unlink(self._path(name))

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes and self.index:
            self._drop(next(iter(self.index)))


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, OSError)


class FileTier:
    """The host tier's files: saves the host copies of nodes and ends; a waiting request's continuation is read back
    into host slots by the prefetcher."""

    def __init__(self, host_pool, config: FileTierConfig, prefetch_policy: str, model_identity: str) -> None:
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of {PREFETCH_POLICIES}, got "
                             f"{prefetch_policy!r}")
        self.pool, self.config, self.prefetch_policy = host_pool, config, prefetch_policy
        self.page_size = host_pool.device_pool.shape.page_size
        self.store = FileStore(config.storage_dir, layout_digest(host_pool, model_identity),
                               int(config.max_size_gb * 2**30))
        self.prefetcher = FilePrefetcher(self)  # the reads, behind the scheduler while requests wait

    # ---- hashes -----------------------------------------------------------------------------------
    def node_hashes(self, node) -> list:
        return node_hashes(node, self.page_size)

    # ---- writes -----------------------------------------------------------------------------------
    def page_saver(self, node):
        """Saving the node's host pages to files, to run once their copy to the host has landed (returns the bytes
        queued): what it saves is taken now, as the node's pages and host slots may change meanwhile."""
        hashes, slots = self.node_hashes(node), list(node.host_pages)
        return lambda: sum(self.store.put(h, self.pool.page_payload(p)) for h, p in zip(hashes, slots)
                           if h not in self.store)

    def end_saver(self, node):
        """The same for the node's host end."""
        key, slot = end_key(self.node_hashes(node)[-1], node.host_next_token), node.host_end
        return lambda: 0 if key in self.store else self.store.put(key, self.pool.end_payload(slot))

    def end_file(self, page_hash: bytes, tokens: list, pos: int) -> Optional[tuple]:
        """(key, next token) of an end file at pos usable by tokens (its next token, if any, is tokens[pos])."""
        for next_token in (None, tokens[pos] if pos < len(tokens) else None):
            key = end_key(page_hash, next_token)
            if key in self.store:
                return key, next_token
        return None

    # ---- reads (in the background while a request waits: mem_cache/file_prefetch.py) --------------------
    def prompt_keys(self, tokens: list) -> tuple:
        """What names a waiting request's files (run on a reader thread): the chain hash after each whole page of
        tokens, and per page the keys of an end file there, (without a next token, with the token after the page or
        None, that token)."""
        ps = self.page_size
        pages, ends = chain_hashes(b"", tokens, ps), []
        for i, h in enumerate(pages):
            pos = (i + 1) * ps
            next_token = tokens[pos] if pos < len(tokens) else None
            ends.append((end_key(h, None), None if next_token is None else end_key(h, next_token), next_token))
        return pages, ends

    def room(self, tier, pages: int, ends: int) -> bool:
        """Whether the host tier has (or makes, as the policy allows) this many free page and end slots."""
        if tier.pages.available() < pages or tier.ends.available() < ends:
            tier.cache.evict_host(max(0, pages - tier.pages.available()), max(0, ends - tier.ends.available()),
                                  backed_only=self.prefetch_policy == "best_effort")
        if (tier.pages.available() < pages or tier.ends.available() < ends) and tier.copies.busy():
            tier.copies.drain()  # what is still short may be slots held back by copies in flight
        return tier.pages.available() >= pages and tier.ends.available() >= ends

    def describe(self) -> str:
        return (f"file tier: {self.store.dir}, {self.store.nbytes / 2**30:.2f} of {self.config.max_size_gb:g} GiB "
                f"held ({len(self.store.index)} files), --hicache-storage-prefetch-policy {self.prefetch_policy}")

    def timeout(self) -> float:
        """Seconds a waiting request waits for its reads (the timeout policy's bound)."""
        return self.config.prefetch_timeout_base if self.prefetch_policy == "timeout" else float("inf")
