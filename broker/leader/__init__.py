"""The acting leader's duties (docs/DESIGN.md §4, §9): the jobs a broker runs only while it
leads, each an object with ``async start()`` / ``async stop()`` (:class:`duty.LeaderDuty`),
started in order when a term opens for writes and stopped in reverse at step-down by
:class:`duties.LeaderDuties`, which both servers (cluster and standalone) build with
:func:`duties.broker_duties`.

One module per duty: ``code_replicas`` (:class:`CodeReplicaMonitor`: readies an artifact
once ``min_code_replicas`` brokers hold it), ``code_retention`` (deletes artifacts no task
needed for a while). Two duties live in their own packages and are duties as they are (the
same start/stop), handed in by the servers: the worker endpoint
(``broker.workers.worker_link.WorkerLink``) and the webhook sender
(``broker.api.webhooks.WebhookSender``: the API shows its delivery failures). The timer and
schedule loops are the replicated node's own (docs/DESIGN.md §4 says why).

It may import broker.core, broker.replication (the node it proposes to), broker.workers
(the worker link), broker.ha (the replica znodes' layout and helpers), log.zk_list (kazoo
calls with a timeout), and nothing from broker.api, broker.server or clients/.
"""
