/* ds4_oracle_driver.c: a small program on ds4's public session API (ds4.h) that writes the
 * logits ds4's CPU path computes for explicit token ids.  It is built by
 * scripts/build_ds4_oracle.py against a private, edited copy of ds4 (see that script's
 * docstring); it contains no ds4 code.
 *
 *   driver tokenize MODEL SYSTEM_FILE USER_FILE OUT_IDS
 *       the chat prompt rendered and tokenized by ds4 itself (ds4_encode_chat_prompt, no
 *       thinking), one id a line.
 *   driver logits MODEL IDS_FILE N_VOCAB THREADS OUT_DECODE OUT_ALL_DECODE OUT_PREFILL [POS...]
 *       OUT_DECODE: float32 [n_ids, N_VOCAB], the logits after each id fed one at a time (the
 *       first through ds4_session_sync, i.e. the prefill path, as a real prompt's first token;
 *       the rest through ds4_session_eval, the decode path).  OUT_ALL_DECODE: the same, but a
 *       fresh session's first id takes the decode path too (ds4_session_oracle_decode_first,
 *       build edit 8), so every row is the decode path's.  OUT_PREFILL: float32 [n_pos,
 *       N_VOCAB], for each POS a fresh session synced to ids[0..POS] in one call (the batched
 *       prefill path), the logits of its last row.
 *
 * The logits buffer is read through ds4_session_logits_oracle() and the first token is sent
 * down the decode path by ds4_session_oracle_decode_first(), the accessors the build script
 * appends to its private copy of ds4.c (the public header has only top-k log-probs). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ds4.h"

const float *ds4_session_logits_oracle(ds4_session *s);
void ds4_session_oracle_decode_first(ds4_session *s);

static char *read_all(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); exit(1); }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) { fprintf(stderr, "read %s\n", path); exit(1); }
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static ds4_engine *open_engine(const char *model, int threads) {
    ds4_engine_options opt;
    memset(&opt, 0, sizeof(opt));
    opt.model_path = model;
    opt.backend = DS4_BACKEND_CPU;
    opt.n_threads = threads;
    ds4_engine *e = NULL;
    if (ds4_engine_open(&e, &opt) != 0 || !e) { fprintf(stderr, "cannot open %s\n", model); exit(1); }
    return e;
}

static int cmd_tokenize(int argc, char **argv) {
    if (argc != 6) { fprintf(stderr, "usage: tokenize MODEL SYSTEM_FILE USER_FILE OUT_IDS\n"); return 2; }
    ds4_engine *e = open_engine(argv[2], 1);
    char *sys = read_all(argv[3]);
    char *user = read_all(argv[4]);
    ds4_tokens toks = {0};
    ds4_encode_chat_prompt(e, sys[0] ? sys : NULL, user, DS4_THINK_NONE, &toks);
    FILE *out = fopen(argv[5], "w");
    if (!out) { perror(argv[5]); return 1; }
    for (int i = 0; i < toks.len; i++) fprintf(out, "%d\n", toks.v[i]);
    fclose(out);
    ds4_tokens_free(&toks);
    free(sys);
    free(user);
    ds4_engine_close(e);
    return 0;
}

static void read_ids(const char *path, ds4_tokens *ids) {
    FILE *f = fopen(path, "r");
    if (!f) { perror(path); exit(1); }
    int v;
    while (fscanf(f, "%d", &v) == 1) ds4_tokens_push(ids, v);
    fclose(f);
}

static void write_row(FILE *out, ds4_session *s, int n_vocab) {
    const float *lg = ds4_session_logits_oracle(s);
    if (fwrite(lg, sizeof(float), (size_t)n_vocab, out) != (size_t)n_vocab) { fprintf(stderr, "write\n"); exit(1); }
}

static void check(int rc, const char *what, const char *err) {
    if (rc != 0) { fprintf(stderr, "%s failed: %s\n", what, err); exit(1); }
}

/* Every id fed one at a time into a fresh session, the logits after each into OUT; the first
 * through ds4_session_sync (the prefill path) unless all_decode, which sends it down the decode
 * path too. */
static void token_by_token(ds4_engine *e, const ds4_tokens *ids, int ctx, int n_vocab, int all_decode,
                           const char *path) {
    char err[512] = {0};
    FILE *out = fopen(path, "wb");
    if (!out) { perror(path); exit(1); }
    ds4_session *s = NULL;
    check(ds4_session_create(&s, e, ctx), "session_create", "");
    if (all_decode) ds4_session_oracle_decode_first(s);
    ds4_tokens first = {0};
    ds4_tokens_push(&first, ids->v[0]);
    check(ds4_session_sync(s, &first, err, sizeof(err)), "sync", err);
    write_row(out, s, n_vocab);
    for (int i = 1; i < ids->len; i++) {
        check(ds4_session_eval(s, ids->v[i], err, sizeof(err)), "eval", err);
        write_row(out, s, n_vocab);
    }
    fclose(out);
    ds4_session_free(s);
    ds4_tokens_free(&first);
}

static int cmd_logits(int argc, char **argv) {
    if (argc < 9) { fprintf(stderr, "usage: logits MODEL IDS N_VOCAB THREADS OUT_DECODE OUT_ALL_DECODE OUT_PREFILL [POS...]\n"); return 2; }
    const int n_vocab = atoi(argv[4]);
    ds4_engine *e = open_engine(argv[2], atoi(argv[5]));
    ds4_tokens ids = {0};
    read_ids(argv[3], &ids);
    const int ctx = ids.len + 64;
    char err[512] = {0};

    token_by_token(e, &ids, ctx, n_vocab, 0, argv[6]);
    token_by_token(e, &ids, ctx, n_vocab, 1, argv[7]);

    ds4_session *s = NULL;
    FILE *pre = fopen(argv[8], "wb");
    if (!pre) { perror(argv[8]); return 1; }
    for (int a = 9; a < argc; a++) {
        const int p = atoi(argv[a]);
        if (p < 0 || p >= ids.len) { fprintf(stderr, "position %d outside the ids\n", p); return 1; }
        ds4_tokens prefix = {0};
        for (int i = 0; i <= p; i++) ds4_tokens_push(&prefix, ids.v[i]);
        check(ds4_session_create(&s, e, ctx), "session_create", "");
        check(ds4_session_sync(s, &prefix, err, sizeof(err)), "sync", err);
        write_row(pre, s, n_vocab);
        ds4_session_free(s);
        ds4_tokens_free(&prefix);
    }
    fclose(pre);
    ds4_tokens_free(&ids);
    ds4_engine_close(e);
    return 0;
}

#ifdef DS4_ORACLE_DUMP
/* driver dump MODEL IDS_FILE N_VOCAB THREADS OUT_LOGITS: every id through the decode path (the
 * first too, build edit 8), the logits after each; the private build (edit 7) writes its
 * intermediates where DS4_ORACLE_DUMP says. */
static int cmd_dump(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: dump MODEL IDS N_VOCAB THREADS OUT_LOGITS\n"); return 2; }
    ds4_engine *e = open_engine(argv[2], atoi(argv[5]));
    ds4_tokens ids = {0};
    read_ids(argv[3], &ids);
    token_by_token(e, &ids, ids.len + 64, atoi(argv[4]), 1, argv[6]);
    ds4_tokens_free(&ids);
    ds4_engine_close(e);
    return 0;
}

/* driver dump-prefill MODEL IDS_FILE N_VOCAB THREADS OUT_LOGITS: a fresh session synced to all ids
 * in one call (the batched prefill path), the last row's logits; the private build writes the
 * prefill path's intermediates, one record per row, where DS4_ORACLE_DUMP says. */
static int cmd_dump_prefill(int argc, char **argv) {
    if (argc != 7) { fprintf(stderr, "usage: dump-prefill MODEL IDS N_VOCAB THREADS OUT_LOGITS\n"); return 2; }
    ds4_engine *e = open_engine(argv[2], atoi(argv[5]));
    ds4_tokens ids = {0};
    read_ids(argv[3], &ids);
    char err[512] = {0};
    FILE *out = fopen(argv[6], "wb");
    if (!out) { perror(argv[6]); return 1; }
    ds4_session *s = NULL;
    check(ds4_session_create(&s, e, ids.len + 64), "session_create", "");
    check(ds4_session_sync(s, &ids, err, sizeof(err)), "sync", err);
    write_row(out, s, atoi(argv[4]));
    fclose(out);
    ds4_session_free(s);
    ds4_tokens_free(&ids);
    ds4_engine_close(e);
    return 0;
}
#endif

int main(int argc, char **argv) {
#ifdef DS4_ORACLE_DUMP
    if (argc >= 2 && strcmp(argv[1], "dump") == 0) return cmd_dump(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "dump-prefill") == 0) return cmd_dump_prefill(argc, argv);
#endif
    if (argc >= 2 && strcmp(argv[1], "tokenize") == 0) return cmd_tokenize(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "logits") == 0) return cmd_logits(argc, argv);
    fprintf(stderr, "usage: %s tokenize|logits ...\n", argv[0]);
    return 2;
}
