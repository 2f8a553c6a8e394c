/* What the verbs probes share (verbs_cost, stream_bw; linked with
 * libibverbs): an RC QP taken to RTS towards a QP of the first port's LID,
 * with the attributes perftest gives its QPs. Dies (DIE, which the probe
 * defines) when a transition fails. */
#ifndef SHMRDMA_BENCH_PROBE_VERBS_H
#define SHMRDMA_BENCH_PROBE_VERBS_H

#include <infiniband/verbs.h>
#include <stdint.h>
#include <string.h>

/* INIT (port 1, `access` granted to the peer), RTR towards dest at lid
 * (MTU 4096, an RNR timer of 0.01 ms), RTS (retry and RNR retry 7: an RNR
 * retries without end). */
static inline void probe_rc_to_rts(struct ibv_qp *qp, uint32_t dest, uint16_t lid, unsigned access)
{
    struct ibv_qp_attr a;
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    a.qp_access_flags = access;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) DIE("INIT");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = IBV_MTU_4096;
    a.dest_qp_num = dest;
    a.ah_attr.dlid = lid;
    a.ah_attr.port_num = 1;
    a.max_dest_rd_atomic = 1;
    a.min_rnr_timer = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                  IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
        DIE("RTR");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    a.retry_cnt = 7;
    a.rnr_retry = 7;
    a.max_rd_atomic = 1;
    if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                  IBV_QP_MAX_QP_RD_ATOMIC))
        DIE("RTS");
}

#endif
