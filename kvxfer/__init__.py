"""kvxfer's shared layer: what the daemon (``kvxferd``) and the SDK (``kvxfer_client``) both
speak, so that neither reaches into the other.

==================  =====================================================================
``errors``          the one exception tree and its mapping to gRPC status codes
``ticket``          the ticket an offer hands out and a pull redeems
``layout``          where each block's bytes lie in a pool (regions, model facts)
``geometry``        which KV heads a pool holds (heterogeneous tensor parallelism)
``host_memory``     shared host memory an engine registers (memfd, sealed) and a daemon maps
``cuda``            the CUDA driver calls both sides make (IPC handles, tensor facts)
``dlpack``          reading a tensor's extent through DLPack
``tls``             the certificate files of an mTLS deployment
``defaults``        the socket path and gRPC channel limits both ends use
``batching``        a stream writer's outbox: the messages ready together in one write
``version``         the package and wire-protocol versions
``proto``           the generated protobuf and gRPC modules (from ``proto/``)
==================  =====================================================================

Nothing here imports ``kvxferd`` or ``kvxfer_client``. Engines import the SDK
(``kvxfer_client``), which re-exports what users need from here.
"""
