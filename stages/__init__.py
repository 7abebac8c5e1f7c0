"""The five stage commands as plain functions (`rlctl.stages.<name>.run`), each a thin
read → compute → write over a pure table function that the pipeline calls directly."""
