//! Stagehand's load generators and benchmarks. Each benchmark is a binary under `src/bin/`
//! that measures Stagehand side by side with a raw baseline on the same machine and data, and
//! prints a table; none of them is a test.
