/* cmd.h - the subcommands of the `kvasir` binary, one file each in src/cli/. Each takes the
 * arguments after its own name (argv[0] is the subcommand) and returns the exit status. */
#ifndef KVR_CLI_CMD_H
#define KVR_CLI_CMD_H

int kvr_cmd_run(int argc, char **argv);
int kvr_cmd_info(int argc, char **argv);
int kvr_cmd_synth(int argc, char **argv);
int kvr_cmd_stage(int argc, char **argv);
int kvr_cmd_experts(int argc, char **argv);
int kvr_cmd_plan(int argc, char **argv);
int kvr_cmd_serve(int argc, char **argv);
int kvr_cmd_bridge(int argc, char **argv);
int kvr_cmd_bench(int argc, char **argv);
int kvr_cmd_top(int argc, char **argv);
int kvr_cmd_tokenize(int argc, char **argv);

#endif
