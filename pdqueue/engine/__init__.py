"""The inference engine: sequences, paged KV blocks, scheduling, the model runner.

Imports torch and pdqueue.models; never redis or zmq.
"""
