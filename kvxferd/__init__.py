"""kvxferd: the per-node daemon that moves KV-cache blocks between serving engines.

Layout of the package, top (what starts the process) to bottom (what moves bytes):

* ``_daemon`` — process lifecycle: settings, listeners, the node, signals, drain;
* ``control/`` — the engine and admin gRPC services, the fd socket, the listeners;
* ``peer/`` — the peer protocol, both ends: the service other daemons call and our calls
  and transfer streams to them;
* ``_node`` — the daemon's state and its acts (register, offer, pull, push, release), each
  admitted by ``_admission`` (draining, whose pools); ``_sessions``, ``_offers``,
  ``_transfers`` — its tables; ``_snapshot`` — what readers outside the loop see;
* ``handoff/`` — the handoff acts: a pull, local copies, the two sides of a remote transfer,
  pushes, shared reads;
* ``transports/`` — how bytes cross between daemons, one room per transport (UCX tagged
  messages, same-host direct reads, TCP lanes) with one face, chosen once per transfer;
* ``tier/`` — the node's KV tier: stored prefixes in host memory and on disk, offered like
  any offer;
* ``dataplane/`` — segment plans, host and GPU copies, staging memory, UCX and TCP lanes;
* ``memory/`` — engine pools mapped into the daemon (shared memory, process memory, CUDA IPC);
* ``edge/`` — the rules of every gRPC service: the checks of what they receive (``wire``) and
  one error-to-status mapping (``rpc``);
* ``_wiring`` — the composition root; ``_parts``, ``_services`` — parts built for the node and
  what the handoff rooms share (settings, copy threads, GPUs, fault points, block integrity
  in ``_integrity``: what a digest covers in ``_digest``, a remapped stream's windows in
  ``_stream_sums``, a check's CPU time in ``_cpu_time``); ``_steps`` — chunk bounds and steps
  with deadlines, for every path;
* ``_config`` — settings (defaults < YAML < ``KVXFERD_*`` < flags); ``_log``, ``_metrics``,
  ``_faults`` — logs, metrics, fault-injection points.

What the daemon shares with the SDK (errors, tickets, layouts, protos) is in :mod:`kvxfer`.
Engines never import this package; they use :mod:`kvxfer_client`.
"""

from kvxfer.version import __version__

from ._config import Settings, load_settings

__all__ = ["Settings", "__version__", "load_settings"]
