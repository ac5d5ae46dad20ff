"""The accuracy study's parts (the command is ``benchmarks/accuracy.py``).

* ``stats``: means, standard deviations, the paired t-interval, figures to a reference's accuracy;
* ``workloads``: the models, data sets and splits;
* ``runs``: the rows' optimizers and controllers, and one training run;
* ``tuning``: the trials on the validation split, the same number per optimizer;
* ``report``: the tables, the ablation and the targets.
"""
