"""The donor side of zwdx: an agent that joins a room and runs ranks of jobs.

    agent   connect, register, heartbeat, receive jobs, launch and watch rank processes
    runner  one process per rank: rendezvous, wrap the model, train, report
    reporter metrics, logs and results from a rank back to the server
    gpus    what this machine offers (pynvml), or one CPU slot
    host    which machine this is (GPU clients on one share its RAM), which modules it can import
"""
