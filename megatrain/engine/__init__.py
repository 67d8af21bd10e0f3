"""The engine that training and every measurement drive: StreamedTrainer binds a Program to the executor, the host store and (with several ranks) the parallel strategy."""
