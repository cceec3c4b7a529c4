// The commands that do their work in this one process: `generate`, `export`,
// `prepare`, `bench` (training throughput; `bench comm` launches workers,
// launch_commands.h), `report` and `simulate`. Each parses its key=value
// arguments and returns the process's exit code; bad input throws
// std::invalid_argument in one line. The *_keys_help are their --help.
#pragma once
#include <string>
#include <vector>

namespace noloco {

int generate_command(const std::string& checkpoint, const std::vector<std::string>& args);
std::string generate_keys_help();

int export_command(const std::string& checkpoint, const std::string& hf_dir, const std::vector<std::string>& args);
std::string export_keys_help();

// Inputs are the words without '='.
int prepare_command(const std::vector<std::string>& args);
std::string prepare_keys_help();

// Config keys, bench_steps and peak_tflops; or "comm" and bench comm's keys.
int bench_command(const std::vector<std::string>& args);

// Run directories are the words without '='.
int report_command(const std::vector<std::string>& args);
std::string report_keys_help();

int simulate_command(const std::vector<std::string>& args);
std::string simulate_keys_help();

}  // namespace noloco
