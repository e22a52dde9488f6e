"""DeepSpeed's engine, on top of gas_lab's floor: what makes a loop written for ``deepspeed.initialize`` run
unchanged on :func:`gas_lab.initialize`, with the same numbers."""
