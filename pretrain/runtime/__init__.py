"""How a training process lives on its machine: `omniloom launch` (accelerate launch with the exit
codes and signals a scheduler relies on), the lifeline (ranks stop when their launcher dies), stop
signals, CPU thread counts and the allocator policy. Nothing here builds a model or reads data.

    launch.py  lifeline.py  signals.py  threads.py  malloc.py
"""
