"""Scale-out on existing engines: KV transfer between prefill and decode workers.

A request's KV travels as ONE contiguous page-first segment (one large message instead of one per
(layer, page): 14.7 ms against 188.6 ms for 5.37 GB on 2xH200), into a slice of the decode side's
staging buffer.

- ``segment_allocator``: ``SegmentAllocator``, contiguous slices of the staging buffer (best fit,
  coalescing free; no torch).
- ``segment_sim``: ``fragmentation_figure``, the allocator under a random long/short workload.
- ``transport``: the ``Transport`` interface (send / recv / poll / wait with a deadline / cancel),
  ``TransferHandle``, errors, and the ``Compat`` handshake; re-exports the implementations:
- ``fake_transport``: ``FakeNetwork`` / ``FakeTransport``, in-process, failing or hanging on demand.
- ``torch_transport``: ``TorchDistTransport`` (isend/irecv on gloo or NCCL), and
  ``send_fragments`` / ``recv_fragments`` for benchmarks.
- ``nixl_transport``: ``NixlTransport``, optional (needs ``nixl``).
- ``bench_transfer``: ``run_transfer_bench``, one segment against per-(layer, page) fragments.

Nothing here is imported by this package's ``__init__``: importing ``flash_dllm.distributed``
costs nothing, and NIXL loads only when ``NixlTransport`` is used.
"""
