"""How bytes cross between two daemons, one room per transport with the same two faces
(:mod:`.faces`: a receiver on the decode side, a sender on the offering side), chosen once per
transfer (:mod:`.choice`).

==================  ===================================================================
``ucx_tags``        UCX tagged messages (RDMA, shared memory, TCP; GPU staging inside)
``direct``          same-host direct reads: proofs, nonces, the reader and the lender
``lanes``           TCP lanes: several TCP connections at once, one thread each
``plane``           what both sides of a remote transfer share: peers, their UCX
                    endpoints, staging, lanes, fault points
``layers``          layer-wise streaming: which layers move when
==================  ===================================================================
"""
