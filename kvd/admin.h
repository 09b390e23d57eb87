/* kvd_admin: the admin requests of the control plane, server-wide views
 * and acts (kvctl: ServerStats, Clients, SeqList, SeqAdmin, Limits, Drain,
 * Shares, ShareDrop, Metrics; docs/PROTOCOL.md, "Admin requests").  What a
 * caller sees is its own uid's unless it is privileged (c->admin).  Loop
 * thread, under the state lock; called by kvd/control.c, which reads the
 * socket and answers the session's own requests.
 */
#ifndef KVD_ADMIN_H
#define KVD_ADMIN_H

#include <stdint.h>

#include "kvd.pb-c.h"
#include "proto/ctl.h"

struct client;
struct kvd_server;

/* Answers rq, one of the requests above: 0, or the -errno of a reply that
 * could not be sent (the caller kicks the client). */
int kvd_admin_request(struct kvd_server *s, struct client *c, const Kvd__Request *rq);

/* Rows a listing page holds: the caller's limit, at most KVD_CTL_LIST_MAX. */
static inline uint32_t kvd_admin_page(uint32_t limit)
{
	return limit && limit < KVD_CTL_LIST_MAX ? limit : KVD_CTL_LIST_MAX;
}

#endif
