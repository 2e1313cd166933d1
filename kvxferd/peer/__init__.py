"""The peer protocol, both ends of ``PeerService`` (``proto/kvxfer/v1/peer.proto``).

==================  ===================================================================
``service``         what other daemons call on us: Hello, Announce, ExtendLease,
                    ProbeDirectRead, TierOffer, and the Transfers stream
``transfers``       our end of a peer's Transfers stream: its pulls of our offers
``identity``        who a peer may say it is (its certificate under mTLS)
``directory``       the peers we call: Hello once, a channel, their identity, the calls
``stream``          our end of the Transfers stream to a peer: our pulls of its offers
==================  ===================================================================

``service`` and ``transfers`` serve (they use the control plane's error mapping and wire
checks); ``directory`` and ``stream`` are what the handoff paths call. Both ends' writers
send the messages ready together in one write (:mod:`kvxfer.batching`).
"""
