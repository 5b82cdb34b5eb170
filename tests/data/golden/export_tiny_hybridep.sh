exit 0
wrote WORK/export_hybridep.sh (hybridep, 292 bytes)
# HybridEP layout for instance tiny (sha256 b0999cd1691eb699...), written by placement export
# every EP group (ep=8) runs 2 node(s) of 4 consecutive EP ranks, each node inside one NVLink domain
export NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN=4
export USE_MNNVL=1
export NVLINK_DOMAIN_SIZE=4
