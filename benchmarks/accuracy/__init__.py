"""The accuracy study's parts (the command is ``benchmarks/accuracy.py``; docs/accuracy.md).

* ``stats``: means, standard deviations and the paired t-interval;
* ``workloads``: the models, data sets and splits;
* ``runs``: the ablation rows' controllers and one training run;
* ``tuning``: the trials on the validation split, the same number per optimizer;
* ``report``: the table.
"""
