/* main.c - `kvasir SUBCOMMAND ...`: dispatch to one file per subcommand. */
#include "cli/cmd.h"
#include "cli/common.h"
#include "core/log.h"
#include "model/engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct subcommand {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
};

static const struct subcommand subcommands[] = {
    {"serve", kvr_cmd_serve, "start a ring on this machine and serve the OpenAI API"},
    {"bridge", kvr_cmd_bridge, "serve the OpenAI API for a ring whose stages run elsewhere"},
    {"run", kvr_cmd_run, "generate text from a prompt with a model (single process)"},
    {"info", kvr_cmd_info, "print a GGUF file's metadata and tensor table"},
    {"tokenize", kvr_cmd_tokenize, "print the token ids of a text with a model's tokenizer"},
    {"plan", kvr_cmd_plan, "write a balanced plan that splits a model over N stages"},
    {"stage", kvr_cmd_stage, "serve one stage of a ring (a layer slice of the model)"},
    {"experts", kvr_cmd_experts, "serve one expert agent (some experts of a MoE model)"},
    {"synth", kvr_cmd_synth, "write a GGUF model with random weights for a named shape"},
    {"bench", kvr_cmd_bench, "load a running server and report latency, throughput, goodput"},
    {"top", kvr_cmd_top, "a live view of a running server's ring (from its /metrics)"},
};

static void usage(FILE *f)
{
    fprintf(f, "usage: kvasir SUBCOMMAND [options]\n\nsubcommands:\n");
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        fprintf(f, "  %-8s %s\n", subcommands[i].name, subcommands[i].help);
    fprintf(f, "\n`kvasir SUBCOMMAND --help` shows a subcommand's options; `kvasir --version` the "
               "version.\n");
}

/* The model layer's options come from the environment, read once here: the model reads none. */
static void configure_model(void)
{
    const char *no_pack = getenv("KVR_NO_PACK");
    struct kvr_model_options o = {
        .kernels = {.isa = getenv("KVR_ISA"), .prefetch = getenv("KVR_PREFETCH")},
        .no_pack = no_pack && !strcmp(no_pack, "1"),
    };
    kvr_model_configure(&o);
}

int main(int argc, char **argv)
{
    kvr_log_set_level(kvr_log_level_from_name(getenv("KVR_LOG")));
    configure_model();
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        kvr_cli_version();
        return 0;
    }
    for (size_t i = 0; i < sizeof subcommands / sizeof subcommands[0]; i++)
        if (!strcmp(argv[1], subcommands[i].name))
            return subcommands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "kvasir: unknown subcommand '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
